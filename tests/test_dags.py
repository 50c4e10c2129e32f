"""The Airflow DAGs parse cleanly and fast, and their tasks are the jobs' spark-submit commands.

Everything Airflow runs in subprocesses (see tests/dags_fixtures.py). The rendered commands
are checked against the jobs themselves: each task's command, with ``--dry-run`` added, must
be accepted by the job's own CLI (so a DAG cannot pass a config key a job does not have).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dags_fixtures import REPO, airflow_home, parse_one, run_airflow  # noqa: F401 (fixture)

EXPECTED = {
    "images_pipeline": ["ingest_images", "shard", "train", "report"],
    "hep_pipeline": ["simulate", "ingest_root", "features", "shard", "train", "report"],
}
#: tasks that run with another config than configs/<job>.yaml
CONFIGS = {("images_pipeline", "train"): "train/lenet5.yaml"}
INGEST_TASKS = {"images_pipeline": {"ingest_images"}, "hep_pipeline": {"simulate", "ingest_root"}}
HEAVY = ("pyspark", "torch", "horovod", "petastorm", "uproot", "awkward")


@pytest.fixture(scope="module")
def rendered(airflow_home, tmp_path_factory):
    """Two logical dates rendered after one DagBag fill (one subprocess): the fill's result with each
    date's tasks under ``rendered``, and the output root."""
    root = tmp_path_factory.mktemp("dag_out")
    both = run_airflow(airflow_home, render=[
        {"logical_date": "2026-03-04T00:00:00+00:00",
         "conf": {"output_root": str(root), "extra_sets": {"train": ["epochs=1"]}}},
        {"logical_date": "2026-03-05T00:00:00+00:00", "conf": {"output_root": str(root)}}])
    res, res2 = ({**both, "rendered": r} for r in both["rendered"])
    return res, res2, root


def test_dagbag_loads_every_dag_without_import_errors_and_parses_fast(airflow_home, rendered):
    res = rendered[0]       # the DagBag fill of the folder (before any rendering)
    assert res["import_errors"] == {}
    assert set(EXPECTED) <= set(res["dag_ids"])
    by_file = {Path(s["file"]).name: s for s in res["stats"]}
    assert {"hep_pipeline.py", "images_pipeline.py"} <= set(by_file)
    assert "spark_jobs.py" not in by_file, "the helper module must be in .airflowignore"
    assert res["heavy_modules"] == [], f"parsing the DAGs imported {res['heavy_modules']}"
    # Parse time per file, each parsed cold in a fresh interpreter (Airflow itself already
    # imported, as in the DAG processor). The limit is on CPU seconds, which the load other
    # processes put on this shared machine does not inflate; wall time is printed alongside.
    for name in ("hep_pipeline.py", "images_pipeline.py"):
        p = parse_one(airflow_home, REPO / "airflow_dags" / name)
        print(f"parse {name}: {p['cpu_s'] * 1000:.0f} ms CPU, {p['wall_s'] * 1000:.0f} ms wall "
              f"(in one DagBag fill: {by_file[name]['duration_s'] * 1000:.0f} ms)")
        assert p["errors"] == {} and p["dags"] == [name[:-3]]
        assert p["heavy_modules"] == []
        assert p["cpu_s"] < 1.0, f"{name}: {p['cpu_s']:.2f} CPU seconds to parse"


def test_dag_files_import_nothing_heavy(tmp_path):
    """Importing a DAG file alone (a fresh interpreter) pulls in none of the heavy libraries."""
    code = ("import sys; sys.path.insert(0, 'airflow_dags'); import hep_pipeline, images_pipeline; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    from dags_fixtures import airflow_env

    env = airflow_env(tmp_path)  # only parse-time settings matter here; no DB is touched
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_tasks_are_spark_submits_of_the_jobs_with_run_scoped_outputs(rendered):
    res, res2, root = rendered
    for dag_id, jobs in EXPECTED.items():
        dag = res["rendered"][dag_id]
        assert dag["catchup"] is False
        assert "daily" in dag["schedule"] or "0 0 * * *" in dag["schedule"]
        tasks = dag["tasks"]
        for job in jobs:
            t = tasks[job]
            assert t["type"] == "PipelineJobOperator"
            assert t["application"] == str(REPO / "jobs" / f"{job}.py")
            assert t["conn_id"] == "spark_local"  # from PIPELINE_SPARK_CONN_ID
            args = t["args"]
            cfg = REPO / "configs" / CONFIGS.get((dag_id, job), f"{job}.yaml")
            if cfg.is_file():
                assert args[:2] == ["--config", str(cfg)]
            sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
            assert "spark.master=null" in sets
            paths = [v.split("=", 1)[1] for v in sets if v.split("=", 1)[1].startswith(str(root))]
            assert paths, f"{dag_id}.{job} writes nothing under the output root: {sets}"
            run_dir = f"{root}/{dag_id}/20260304T000000/"
            assert all(p.startswith(run_dir) for p in paths), (dag_id, job, paths)
            # every task's "output" is its own
            outs = [v for v in sets if v.startswith("output=")]
            assert len(outs) == 1
        out_paths = [next(v for v in tasks[j]["args"] if v.startswith("output=")) for j in jobs]
        assert len(set(out_paths)) == len(out_paths)
        # another logical date: the same tasks, disjoint outputs
        other = res2["rendered"][dag_id]["tasks"]
        for job in jobs:
            a = {v for v in tasks[job]["args"] if v.startswith("output=")}
            b = {v for v in other[job]["args"] if v.startswith("output=")}
            assert a != b and all("20260305T000000" in v for v in b)
    # extra_sets reach only the named task
    assert res["rendered"]["images_pipeline"]["tasks"]["train"]["args"][-2:] == ["--set", "epochs=1"]
    assert "epochs=1" not in res["rendered"]["images_pipeline"]["tasks"]["shard"]["args"]


def test_ingestion_and_train_tasks_retry_with_exponential_backoff_and_others_do_not(rendered):
    res, _, _ = rendered
    for dag_id, ingest in INGEST_TASKS.items():
        tasks = res["rendered"][dag_id]["tasks"]
        for task_id, t in tasks.items():
            if task_id in ingest:
                assert t["retries"] == 3 and t["backoff"] > 1 and t["retry_delay_s"] > 0, (task_id, t)
            elif task_id == "train":
                assert t["retries"] == 1 and t["retry_delay_s"] > 0, t
                assert "resume=auto" in t["args"], t["args"]       # the retry continues from the checkpoints
            elif "application" in t:
                assert t["retries"] == 0, task_id


def test_dependencies_follow_the_pipeline(rendered):
    res, _, _ = rendered
    img = res["rendered"]["images_pipeline"]["tasks"]
    assert img["shard"]["upstream"] == ["ingest_images"]
    assert img["train"]["upstream"] == ["shard"]
    assert img["report"]["upstream"] == ["train"]
    hep = res["rendered"]["hep_pipeline"]["tasks"]
    assert hep["simulate"]["upstream"] == ["choose_source"]
    assert hep["ingest_root"]["upstream"] == ["choose_source", "simulate"]
    assert hep["ingest_root"]["trigger_rule"].lower().endswith("none_failed_min_one_success")
    assert hep["features"]["upstream"] == ["ingest_root"]
    assert hep["shard"]["upstream"] == ["features"]
    assert hep["train"]["upstream"] == ["shard"]
    assert hep["report"]["upstream"] == ["train"]
    # defaults of the DAG params come from configs/dag_hep.yaml
    import yaml

    y = yaml.safe_load((REPO / "configs" / "dag_hep.yaml").read_text())["params"]
    p = res["rendered"]["hep_pipeline"]["params"]
    for k in ("algorithm", "workers", "model", "simulate"):
        assert p[k] == y[k], k


def _job_exists(job: str) -> bool:
    return (REPO / "jobs" / f"{job}.py").is_file()


@pytest.mark.parametrize("dag_id,job", [
    pytest.param(d, j, marks=pytest.mark.needs_horovod) if j == "train" else (d, j)   # the DAGs train on Horovod
    for d, jobs in EXPECTED.items() for j in jobs])
def test_every_task_command_is_accepted_by_its_job(rendered, dag_id, job):
    """The rendered command + ``--dry-run`` passes the job's own CLI: every key the DAG sets exists."""
    res, _, root = rendered
    t = res["rendered"][dag_id]["tasks"][job]
    assert _job_exists(job), f"jobs/{job}.py does not exist"
    r = subprocess.run([sys.executable, t["application"], *t["args"], "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    run_dir = f"{root}/{dag_id}/20260304T000000/"
    if r.returncode == 0:
        out = json.loads(r.stdout)
        assert out["config"]["output"].startswith(run_dir)
    else:
        # The config was accepted (it is validated first); only the plan's check of an input
        # that an upstream task of this very run writes failed: one line naming that path.
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1, f"{dag_id}.{job}: {lines[-3:]}"
        assert "config" not in lines[0] and run_dir in lines[0], f"{dag_id}.{job}: {lines[0]}"
