"""Fixtures and helpers of the Airflow DAG tests (tests/test_dags*.py).

Airflow runs in subprocesses, never in the pytest process: importing Airflow configures
logging and an ORM globally, which the rest of the suite should not inherit. Each session
gets a temporary ``AIRFLOW_HOME`` with a SQLite metadata DB (``airflow db migrate``), the
repository's ``airflow_dags/`` as DAG folder, a Spark connection given as an environment
variable (``AIRFLOW_CONN_SPARK_LOCAL``: master ``local[2]``, client mode) and the virtualenv's
``bin`` (``spark-submit``) first on ``PATH``. ``run_dag`` runs one DAG run in-process in such
a subprocess with ``dag.test()`` and returns the task states.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
DAGS = REPO / "airflow_dags"
VENV_BIN = Path(sys.executable).parent
MARK = "@@DAG-RESULT@@"

# Runs inside the subprocess: parse the DAG folder, optionally dag.test() one DAG, print JSON.
_RUNNER = r'''
import json, sys, time
import pendulum
from airflow.dag_processing.dagbag import DagBag

req = json.loads(sys.argv[1])
out = {}
t0 = time.perf_counter()
bag = DagBag(dag_folder=req["dags"])
out["bag_s"] = time.perf_counter() - t0
out["import_errors"] = {str(k): str(v).strip().splitlines()[-1] for k, v in bag.import_errors.items()}
out["stats"] = [{"file": str(s.file), "duration_s": s.duration.total_seconds(), "dags": s.dags}
                for s in bag.dagbag_stats]
out["dag_ids"] = sorted(bag.dag_ids)
heavy = [m for m in ("pyspark", "torch", "horovod", "petastorm", "uproot", "awkward") if m in sys.modules]
out["heavy_modules"] = heavy
def render(request):
    import copy
    from spark_jobs import with_extra_sets
    rendered = {}
    for dag_id in bag.dag_ids:
        dag = bag.get_dag(dag_id)
        ld = pendulum.parse(request["logical_date"])
        params = {k: dag.params[k] for k in dag.params}
        params.update(request.get("conf") or {})
        tasks = {}
        for t in dag.tasks:
            info = {"type": type(t).__name__, "upstream": sorted(t.upstream_task_ids),
                    "retries": t.retries, "retry_delay_s": t.retry_delay.total_seconds(),
                    "backoff": t.retry_exponential_backoff,
                    "trigger_rule": str(t.trigger_rule)}
            if hasattr(t, "application"):
                r = copy.copy(t)
                r.render_template_fields({"params": params, "logical_date": ld, "run_id": "manual__x",
                                          "ts_nodash": ld.strftime("%Y%m%dT%H%M%S"), "task": r, "dag": dag})
                info.update(application=r.application, conn_id=r._conn_id, conf=r.conf, env=r.env_vars,
                            args=with_extra_sets(r.application_args, params, t.task_id))
            tasks[t.task_id] = info
        rendered[dag_id] = {"tasks": tasks, "params": params, "schedule": str(dag.schedule),
                            "catchup": dag.catchup}
    return rendered
if req.get("render"):
    out["rendered"] = [render(r) for r in req["render"]]
if req.get("dag_id"):
    dag = bag.get_dag(req["dag_id"])
    kw = {"logical_date": pendulum.parse(req["logical_date"]), "run_conf": req.get("conf") or {}}
    if req.get("mark_success"):
        kw["mark_success_pattern"] = req["mark_success"]
    t0 = time.perf_counter()
    dr = dag.test(**kw)
    out["run_s"] = time.perf_counter() - t0
    out["state"] = str(dr.state)
    out["tasks"] = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
print("@@DAG-RESULT@@" + json.dumps(out))
'''


# Runs in a fresh subprocess per DAG file: Airflow imported first (the DAG processor has it
# loaded), then the file parsed cold; wall and CPU seconds of that parse.
_PARSE_ONE = r'''
import json, sys, time
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1], collect_dags=False)
w0, c0 = time.perf_counter(), time.process_time()
dags = bag.process_file(sys.argv[2], only_if_updated=False)
w1, c1 = time.perf_counter(), time.process_time()
heavy = [m for m in ("pyspark", "torch", "horovod", "petastorm", "uproot", "awkward") if m in sys.modules]
print("@@DAG-RESULT@@" + json.dumps({"wall_s": w1 - w0, "cpu_s": c1 - c0, "dags": [d.dag_id for d in dags],
                                     "errors": {str(k): str(v)[-500:] for k, v in bag.import_errors.items()},
                                     "heavy_modules": heavy}))
'''


def parse_one(env: dict[str, str], path: Path) -> dict[str, Any]:
    """Parse one DAG file cold in a fresh interpreter: wall/CPU seconds, DAG ids, errors."""
    r = subprocess.run([sys.executable, "-c", _PARSE_ONE, str(DAGS), str(path)], env=env, capture_output=True,
                       text=True, timeout=300, cwd=str(REPO))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(MARK)]
    assert r.returncode == 0 and lines, f"parsing {path} failed: {r.stderr[-3000:]}"
    return json.loads(lines[-1][len(MARK):])


def airflow_env(home: Path, conn_id: str = "spark_local") -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        # local[2] as the connection's master (URL-quoted brackets), client deploy mode
        "AIRFLOW_CONN_" + conn_id.upper(): "spark://local%5B2%5D?deploy-mode=client",
        "PIPELINE_SPARK_CONN_ID": conn_id,
        # the tests trigger runs with any conf (docs/airflow.md#what-a-trigger-may-change)
        "AIRFLOW_VAR_PIPELINE_TRIGGER_KEYS": '{"params": ["*"], "extra_sets": {"*": ["*"]}}',
        "PATH": str(VENV_BIN) + os.pathsep + os.environ.get("PATH", ""),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONUNBUFFERED": "1",
    })
    return env


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory) -> dict[str, str]:
    """A migrated SQLite Airflow home; returns the environment for Airflow subprocesses."""
    home = tmp_path_factory.mktemp("airflow_home")
    env = airflow_env(home)
    r = subprocess.run([str(VENV_BIN / "airflow"), "db", "migrate"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"airflow db migrate failed: {r.stderr[-2000:]}"
    return env


def run_airflow(env: dict[str, str], dag_id: Optional[str] = None, logical_date: Optional[str] = None,
                conf: Optional[dict] = None, mark_success: Optional[str] = None,
                timeout: int = 900, extra_env: Optional[dict] = None,
                render: Optional[list[dict]] = None) -> dict[str, Any]:
    """Parse the DAG folder in a subprocess, and: ``render`` (a list of {"logical_date", "conf"}) every
    task's templated fields for each (``rendered``: one dict per request), or ``dag.test()`` one run of
    ``dag_id``. Returns the JSON result."""
    req = {"dags": str(DAGS), "dag_id": dag_id, "logical_date": logical_date, "conf": conf,
           "mark_success": mark_success, "render": render}
    env = {**env, **(extra_env or {})}
    log = Path(env["AIRFLOW_HOME"]) / f"run-{dag_id or 'parse'}-{len(list(Path(env['AIRFLOW_HOME']).glob('run-*')))}.log"
    with open(log, "w") as fh:
        r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(req)], env=env, stdout=fh,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=str(REPO))
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith(MARK)]
    assert r.returncode == 0 and lines, f"airflow runner failed (rc={r.returncode}), log {log}:\n{text[-6000:]}"
    res = json.loads(lines[-1][len(MARK):])
    res["log"] = str(log)
    if dag_id and not str(res.get("state")).endswith("success"):
        # the lines that say why: the jobs' one-line errors and Airflow's task failures
        why = [ln for ln in text.splitlines() if "error:" in ln or "ERROR" in ln or "Traceback" in ln]
        res["why"] = why[-15:]
    return res


def dag_run_summary(res: dict) -> str:
    return json.dumps({k: res.get(k) for k in ("state", "tasks", "run_s", "log", "why")}, indent=1)


def leftovers(root: Path) -> list[str]:
    """Temporary/backup directories of atomic writes (``.<name>.tmp-*``/``.old-*``) under root."""
    return sorted(str(p) for p in root.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name)
