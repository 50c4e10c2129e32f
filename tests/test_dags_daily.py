"""The daily ingestion DAG end to end (issue 37): ``hep_ingest_daily`` run with ``dag.test()`` on two
days, real ``spark-submit`` tasks on local[2], files landing between the runs. Day two reads only the
new files; the table then holds every file's rows once; day two's features and shards are built
from the table's snapshot (both days' files). Day one's features and shards are marked successful
without running: they are the same tasks on a smaller snapshot, and ``features`` reads the newest
snapshot, never an earlier day's output."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dags_fixtures import REPO, airflow_home, dag_run_summary, run_airflow  # noqa: F401 (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]   # two DAG runs: four spark-submit tasks

CLASSES = ("qcd", "ttbar", "wjets")


def _land(landing: Path, delphes: Path, index: int) -> None:
    """One copy of the real Delphes file per class (25 events, one selected) in the landing folder."""
    for c in CLASSES:
        (landing / c).mkdir(parents=True, exist_ok=True)
        shutil.copy(delphes, landing / c / f"{c}_{index:02d}.root")


def _day(env: dict, logical: str, conf: dict, mark_success: str | None = None) -> dict:
    res = run_airflow(env, "hep_ingest_daily", logical, conf=conf, timeout=1200, mark_success=mark_success)
    assert res["state"].endswith("success"), dag_run_summary(res)
    assert all(res["tasks"][t].endswith("success") for t in ("ingest_root", "features", "shard")), \
        dag_run_summary(res)
    return res


@pytest.mark.timeout(2400)
def test_two_days_append_only_the_new_files_and_build_from_the_snapshot(airflow_home, tmp_path, delphes_root):
    from pipeline.fs import location
    from pipeline.tables import deltalog
    from pipeline.tables.ledger import read_ledger

    cfg = tmp_path / "configs"
    shutil.copytree(REPO / "configs", cfg)
    d = yaml.safe_load((cfg / "dag_hep_ingest_daily.yaml").read_text())
    d["ingest_retries"]["retries"] = 0
    (cfg / "dag_hep_ingest_daily.yaml").write_text(yaml.safe_dump(d))
    env = {**airflow_home, "PIPELINE_DAG_CONFIG_DIR": str(cfg)}
    landing, table, out = tmp_path / "landing", tmp_path / "table", tmp_path / "runs"
    conf = {"landing": str(landing / "*" / "*.root"), "table": str(table), "output_root": str(out),
            "spark_master": "local[2]", "extra_sets": {"features": ["test_fraction=0.25", "val_fraction=0.25"]}}
    for i in range(4):
        _land(landing, delphes_root, i)
    _day(env, "2026-11-01T00:00:00+00:00", conf, mark_success="^(features|shard)$")
    _land(landing, delphes_root, 4)
    _day(env, "2026-11-02T00:00:00+00:00", conf)

    loc = location(str(table))
    commits = deltalog.commits(loc)
    assert [v for v, _ in commits] == [0, 1]
    day1, day2 = ([s["file"] for s in rec["sources"]] for _, rec in commits)
    assert len(day1) == 12 and sorted(day2) == sorted(str(landing / c / f"{c}_04.root") for c in CLASSES)
    assert sorted(read_ledger(loc).sources) == sorted(str(p) for p in landing.glob("*/*.root"))
    snap = deltalog.snapshot(loc)
    assert len(snap.files) == 15 and sum(f.rows for f in snap.files) == 15 * 25

    runs = out / "hep_ingest_daily"
    assert not (runs / "20261101T000000" / "features").exists()            # marked successful, not run
    day = runs / "20261102T000000"
    rep = json.loads((day / "features" / "report.json").read_text())
    assert sorted(f["file"] for f in rep["files"]) == sorted(day1 + day2) and not rep["bad_files"]
    assert sum(f["selected"] for f in rep["files"]) == 15                   # one selected event per file
    manifest = json.loads((day / "shards" / "manifest.json").read_text())
    assert manifest["n_train_samples"] == rep["splits"]["train"] > 0
