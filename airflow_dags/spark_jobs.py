"""Building blocks of the pipeline DAGs: one ``spark-submit jobs/<name>.py`` task per stage.

The DAG files (``hep_pipeline.py``, ``images_pipeline.py``) only wire tasks together; every
piece of pipeline logic lives in ``pipeline/`` and runs inside the submitted job. So this
module imports nothing heavy: Airflow's SDK, the Spark provider's operator and PyYAML. Both
paths a user has (a scheduled DAG run and a hand-typed ``spark-submit``) run the same command:

    spark-submit [--conf k=v ...] <repo>/jobs/<job>.py --config <configs>/<job>.yaml \
        --set spark.master=<param or null> --set <io key>=<run-scoped path> ... [--set <extra>]

Design points:

* **Settings** come from ``configs/dag_<name>.yaml`` (read once at parse time into the typed
  models of :mod:`pipeline.dag_settings`; a bad key or value fails the DAG's import naming both):
  the schedule, the Spark connection id, retries and back-off of the ingestion tasks, extra
  ``--conf`` per task (GPU resources for training, for example) and the defaults of the DAG
  params. ``PIPELINE_DAG_CONFIG_DIR`` points at another folder of YAML files (job configs
  included), ``PIPELINE_SPARK_CONN_ID`` overrides the connection id.
* **Run-scoped outputs**: every output path is ``<output_root>/<dag_id>/<run key>/<what>``
  where the run key is the logical date (``ts_nodash``; the run id when a run has no
  logical date). A rerun or backfill of one logical date writes into the same directory and
  each job replaces its own output atomically (``pipeline.outputs.atomic_output_dir``), so
  there is always exactly one set of outputs per logical date and no other run is touched.
* **Master**: the connection's master is what ``spark-submit --master`` gets; the DAG param
  ``spark_master`` (empty by default) additionally overrides ``spark.master`` inside the job.
* **Extra overrides**: the DAG param ``extra_sets`` maps a task id to a list of ``key=value``
  strings appended as ``--set`` to that task's command (for example a one-epoch run:
  ``{"train": ["train.epochs=1"]}``).
* **What a trigger may change**: only the params and ``extra_sets`` keys the Airflow Variable
  ``pipeline_trigger_keys`` enables; every task refuses any other key of its run's conf in one
  line before ``spark-submit`` (:func:`check_trigger`, docs/airflow.md#what-a-trigger-may-change).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

#: the repository root (this file lives in ``<repo>/airflow_dags/``)
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from pipeline.dag_settings import DagSettingsBase, load_dag_settings  # noqa: E402 - pydantic + PyYAML only

#: a Jinja expression naming the run: the logical date, else the run id (manual runs of
#: Airflow 3 may have no logical date); only characters that are safe in a path.
RUN_KEY = ("{{ ts_nodash if (logical_date is defined and logical_date) "
           "else run_id | replace(':', '') | replace('+', '') | replace('/', '_') }}")


def config_dir() -> Path:
    """Folder holding ``dag_*.yaml`` and the jobs' configs (``PIPELINE_DAG_CONFIG_DIR``)."""
    return Path(os.environ.get("PIPELINE_DAG_CONFIG_DIR") or REPO / "configs").resolve()


def repo_path(p: str | os.PathLike) -> str:
    """Absolute path; relative ones are taken from the repository root."""
    path = Path(os.path.expanduser(str(p)))
    return str(path if path.is_absolute() else (REPO / path))


def input_path(p: str) -> str:
    """Like :func:`repo_path` for plain paths; URLs and ``samples:NAME`` are left as they are."""
    s = str(p)
    return s if (not s or ":" in s.split("/", 1)[0]) else repo_path(s)


def run_dir(dag_id: str) -> str:
    """Jinja template of this run's output directory."""
    return "{{ params.output_root }}/" + dag_id + "/" + RUN_KEY


class DagSettings:
    """The parse-time settings of one DAG (``configs/dag_<name>.yaml``) with their defaults."""

    def __init__(self, name: str, dag_id: str):
        model: DagSettingsBase = load_dag_settings(name, config_dir() / f"dag_{name}.yaml")
        self.model = model
        self.dag_id = dag_id
        self.schedule = model.schedule
        self.start_date = model.start_date
        self.conn_id = os.environ.get("PIPELINE_SPARK_CONN_ID") or model.conn_id
        self.python = model.python or sys.executable
        self.retries = {"ingest": model.ingest_retries, "train": model.train_retries}
        self.spark_conf: dict[str, dict[str, str]] = {
            k: {a: str(b).lower() if isinstance(b, bool) else str(b) for a, b in v.items()}
            for k, v in model.spark_conf.items()}
        self.params: dict[str, Any] = model.params.model_dump()
        self.params["output_root"] = repo_path(self.params["output_root"])

    def dag_kwargs(self) -> dict:
        """The scheduling keywords every pipeline DAG shares: the schedule and start date from
        the settings, no catch-up, one active run at a time (outputs are per logical date)."""
        import pendulum

        return {"schedule": self.schedule, "start_date": pendulum.parse(self.start_date, tz="UTC"),
                "catchup": False, "max_active_runs": 1}

    def retry_kwargs(self, kind: str) -> dict:
        """Retries with exponential back-off of the ``ingest`` or ``train`` tasks."""
        r = self.retries[kind]
        return {"retries": r.retries, "retry_delay": timedelta(seconds=r.delay_s),
                "retry_exponential_backoff": r.backoff, "max_retry_delay": timedelta(seconds=r.max_delay_s)}


def job_args(job: str, sets: Mapping[str, Any], cfg_dir: Optional[Path] = None,
             config: Optional[str] = None) -> list[str]:
    """``--config <dir>/<config or job>.yaml --set spark.master=... --set k=v ...`` (templated
    strings). Values that are lists are passed as YAML flow lists (``k=[a, b]``)."""
    cfg_dir = cfg_dir or config_dir()
    cfg = cfg_dir / f"{config or job}.yaml"
    args = ["--config", str(cfg)] if cfg.is_file() else []  # no file: the job's own defaults
    args += ["--set", "spark.master={{ params.spark_master or 'null' }}"]
    for k, v in sets.items():
        if isinstance(v, (list, tuple)):
            v = "[" + ", ".join(str(x) for x in v) + "]"
        args += ["--set", f"{k}={v}"]
    return args


def with_extra_sets(args: Optional[Sequence[str]], params: Optional[Mapping[str, Any]], task_id: str) -> list[str]:
    """``args`` plus ``--set item`` for each item of ``params["extra_sets"][task_id]``."""
    extra = ((params or {}).get("extra_sets") or {}).get(task_id) or []
    if isinstance(extra, str):
        extra = [extra]
    out = list(args or [])
    for item in extra:
        out += ["--set", str(item)]
    return out


def check_trigger(task: Any, context: Any) -> None:
    """Fail the task, before anything runs, when the DAG run's conf changes what the deployment does not
    enable (Airflow Variable ``pipeline_trigger_keys``; :func:`pipeline.dag_settings.trigger_refusal`)."""
    from airflow.sdk import Variable
    from airflow.sdk.exceptions import AirflowFailException

    from pipeline.dag_settings import TRIGGER_VARIABLE, trigger_refusal

    dag_run = context.get("dag_run")
    conf = getattr(dag_run, "conf", None) or {}
    if not conf:
        return
    defaults = {k: task.dag.params[k] for k in task.dag.params}
    refusal = trigger_refusal(conf, defaults, Variable.get(TRIGGER_VARIABLE, default=None))
    if refusal:
        raise AirflowFailException(refusal)


class PipelineJobOperator(SparkSubmitOperator):
    """``spark-submit jobs/<job>.py`` with the job's config, run-scoped ``--set`` values and the
    ``extra_sets`` DAG param of this task appended at execution time."""

    def __init__(self, *, job: str, sets: Mapping[str, Any], settings: DagSettings,
                 conf: Optional[dict] = None, config: Optional[str] = None, **kwargs: Any) -> None:
        task_id = kwargs.setdefault("task_id", job)
        merged_conf = dict(settings.spark_conf.get("all", {}))
        merged_conf.update(settings.spark_conf.get(task_id, {}))
        merged_conf.update(conf or {})
        super().__init__(
            application=str(REPO / "jobs" / f"{job}.py"),
            application_args=job_args(job, sets, config=config),
            conn_id=settings.conn_id,
            conf=merged_conf,
            name=f"{settings.dag_id}.{task_id}",
            env_vars={"PYSPARK_PYTHON": settings.python, "PYSPARK_DRIVER_PYTHON": settings.python},
            **kwargs,
        )
        self.job = job

    def execute(self, context: Any) -> Any:
        check_trigger(self, context)
        self.application_args = with_extra_sets(self.application_args, context.get("params"), self.task_id)
        self.log.info("spark-submit %s %s", self.application, " ".join(self.application_args))
        return super().execute(context)


def job_task(job: str, sets: Mapping[str, Any], settings: DagSettings, *, retries: Optional[str] = None,
             task_id: Optional[str] = None, **kwargs: Any) -> PipelineJobOperator:
    """One stage as a task; ``retries="ingest"`` / ``"train"`` adds that group's retries with
    exponential back-off (the other tasks fail at once); ``config="train/lenet5"`` runs the job with
    ``configs/train/lenet5.yaml`` instead of ``configs/<job>.yaml``."""
    if retries:
        for k, v in settings.retry_kwargs(retries).items():
            kwargs.setdefault(k, v)
    return PipelineJobOperator(job=job, sets=sets, settings=settings, task_id=task_id or job, **kwargs)


def common_params(settings: DagSettings, defaults: Mapping[str, Any]) -> dict:
    """DAG params shared by the pipelines: ``output_root``, ``spark_master``, ``extra_sets``."""
    from airflow.sdk import Param

    p = {**defaults, **settings.params}
    return {
        "output_root": Param(repo_path(p.get("output_root", "runs/airflow")), type="string",
                             description="root of the run-scoped outputs: <root>/<dag_id>/<logical date>/..."),
        "spark_master": Param(p.get("spark_master") or "", type="string",
                              description="spark.master inside the jobs; empty: the connection's master"),
        "extra_sets": Param(p.get("extra_sets") or {}, type="object",
                            description='per-task extra --set values, e.g. {"train": ["train.epochs=1"]}'),
    }


def stage_paths(dag_id: str, names: Sequence[str]) -> dict[str, str]:
    """Templated run-scoped output path of each named artefact."""
    base = run_dir(dag_id)
    return {n: f"{base}/{n}" for n in names}
