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


@pytest.mark.timeout(2400)
def test_a_landed_file_that_always_fails_is_quarantined_and_the_day_goes_on(airflow_home, tmp_path, delphes_root):
    """Issue 52, item 5: a real truncated ROOT file in the landing folder. Day one's first ingest
    attempt commits the good files and fails for it (failure 1); the retry has nothing but it to
    read, records failure 2 in a version that changes no data, quarantines it and succeeds, so the
    day's features and shards run on what was committed. Day two skips it in one line and adds
    the new files. Five spark-submits: the retry is the case, features and shards must run once."""
    from pipeline.fs import location
    from pipeline.tables import deltalog
    from pipeline.tables.quarantine import listing

    cfg = tmp_path / "configs"
    shutil.copytree(REPO / "configs", cfg)
    d = yaml.safe_load((cfg / "dag_hep_ingest_daily.yaml").read_text())
    d["ingest_retries"].update(retries=1, delay_s=1, backoff=1.0)
    d["params"]["quarantine_after"] = 2
    (cfg / "dag_hep_ingest_daily.yaml").write_text(yaml.safe_dump(d))
    env = {**airflow_home, "PIPELINE_DAG_CONFIG_DIR": str(cfg),
           "AIRFLOW_VAR_PIPELINE_TRIGGER_KEYS": json.dumps({"params": ["*"], "extra_sets": {"*": ["*"]}})}
    landing, table, out = tmp_path / "landing", tmp_path / "table", tmp_path / "runs"
    conf = {"landing": str(landing / "*" / "*.root"), "table": str(table), "output_root": str(out),
            "spark_master": "local[2]", "extra_sets": {"features": ["test_fraction=0.25", "val_fraction=0.25"]}}
    for i in range(4):
        _land(landing, delphes_root, i)
    bad = landing / "ttbar" / "ttbar_cut.root"
    data = delphes_root.read_bytes()
    bad.write_bytes(data[: int(0.02 * len(data))])            # truncated: the header only
    res = _day(env, "2026-11-01T00:00:00+00:00", conf)
    loc = location(str(table))
    commits = deltalog.commits(loc)
    assert [v for v, _ in commits] == [0, 1]
    (_, first), (_, second) = commits
    assert len(first["sources"]) == 12 and [b["file"] for b in first["bad_files"]] == [str(bad)]
    assert not first["quarantined"]                            # failure 1 of 2: that attempt failed
    assert second["sources"] == [] and [q["file"] for q in second["quarantined"]] == [str(bad)]
    assert len(deltalog.snapshot(loc).files) == 12             # the record-only version changed no data
    assert [(q["file"], q["failures"], q["version"]) for q in listing(loc)] == [(str(bad), 2, 1)]
    rep = json.loads((out / "hep_ingest_daily" / "20261101T000000" / "features" / "report.json").read_text())
    assert len(rep["files"]) == 12 and not rep["bad_files"]   # built from what was committed

    _land(landing, delphes_root, 4)
    res = _day(env, "2026-11-02T00:00:00+00:00", conf, mark_success="^(features|shard)$")
    commits = deltalog.commits(loc)
    assert [v for v, _ in commits] == [0, 1, 2]
    assert sorted(s["file"] for s in commits[2][1]["sources"]) == sorted(
        str(landing / c / f"{c}_04.root") for c in CLASSES)
    assert not commits[2][1]["bad_files"]
    log = Path(res["log"]).read_text(errors="replace")
    assert f"{bad}: quarantined at version 1 after 2 failed run(s)" in log
