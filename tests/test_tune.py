"""Tuning (jobs/tune.py): Optuna trials run as parallel Spark tasks on the real digits, the best
config loads with the training config loader, and bad search spaces are refused up front."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from jobs import tune as tune_job

TINY_TRAIN = {"epochs": 1, "max_steps": 20, "eval_every": 5, "batch_size": 32, "progress": False,
              "warmup_epochs": 0, "checkpoint_every": 0}


def tiny_tune(tmp: Path, **over) -> dict:
    doc = {
        "name": "tinytune",
        "workflow": "images",
        "fixed": {"ingest.source": "sklearn_digits", "shard.row_group_rows": 64,
                  **{f"train.{k}": v for k, v in TINY_TRAIN.items()}},
        "space": {"train.lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}},
        "sampler": "random",
        "trials": 2,
        "parallel": 2,
        "output": str(tmp / "tune"),
    }
    doc.update(over)
    return doc


def _write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _best_val(train_dir: Path) -> float:
    recs = [json.loads(ln) for ln in (train_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return max(r["accuracy"] for r in recs if r["split"] == "val")


@pytest.fixture(scope="module")
def finished_tune(spark, tmp_path_factory):
    """The tiny search (2 random trials, 2 at a time), run once through jobs/tune.py."""
    tmp = tmp_path_factory.mktemp("tune")
    # the digits dataset and its shards are cached by config in a directory shared with test_studies.py
    data = tmp_path_factory.getbasetemp() / "studies_data"
    cfg = _write(tmp / "t.yaml", tiny_tune(tmp, data_dir=str(data)))
    assert tune_job.main(["--config", str(cfg)]) == 0
    return cfg, tmp / "tune"


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_tuning_on_spark_writes_a_loadable_best_config(finished_tune, monkeypatch, capsys):
    from pipeline.config import load_config
    from pipeline.train.config import TrainConfig

    _, out = finished_tune
    trials = pd.read_parquet(out / "trials.parquet").sort_values("trial")
    assert list(trials["trial"]) == [0, 1] and set(trials["state"]) == {"COMPLETE"}
    # the two trials ran at the same time, as two tasks of one Spark job
    (s0, e0), (s1, e1) = trials[["task_started", "task_finished"]].to_numpy()
    assert s0 < e1 and s1 < e0
    # objective = best validation accuracy, recomputed from each trial's metrics.jsonl
    values = {int(r.trial): _best_val(out / "trials" / f"trial_{int(r.trial)}" / "train") for r in trials.itertuples()}
    assert values == pytest.approx(dict(zip(trials["trial"], trials["objective"])))
    best_trial = max(values, key=values.get)
    best = json.loads((out / "best.json").read_text())
    assert best["trial"] == best_trial and best["value"] == pytest.approx(values[best_trial])

    loaded = load_config(TrainConfig, out / "best_train.yaml")
    lr = trials.loc[trials["trial"] == best_trial, "param.train.lr"].iloc[0]
    assert loaded.lr == pytest.approx(lr) and 1e-3 <= loaded.lr <= 1e-1
    assert loaded.workers == 1 and loaded.max_steps == 20 and Path(loaded.manifest).is_file()
    from jobs import train as train_job

    capsys.readouterr()
    assert train_job.main(["--config", str(out / "best_train.yaml"), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["total_steps"] == 20

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"file://{out / 'mlruns'}")
    runs = c.search_runs([c.get_experiment_by_name("tinytune").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.params["trial"] for r in kids) == ["0", "1"]
    assert parent.data.metrics["best_value"] == pytest.approx(values[best_trial])
    for k in kids:
        n = int(k.data.params["trial"])
        assert math.isclose(k.data.metrics["final_best_val_accuracy"], values[n])
        recs = (out / "trials" / f"trial_{n}" / "train" / "metrics.jsonl").read_text().splitlines()
        n_val = sum(json.loads(ln)["split"] == "val" for ln in recs if ln.strip())
        assert n_val >= 2 and len(c.get_metric_history(k.info.run_id, "val_accuracy")) == n_val


@pytest.mark.slow
@pytest.mark.e2e
def test_rerunning_a_search_continues_it(finished_tune):
    """More trials on the same output: the finished trials are kept, only the new one runs."""
    cfg, out = finished_tune
    stamps = {n: (out / "trials" / f"trial_{n}" / "train" / "summary.json").stat().st_mtime_ns for n in (0, 1)}
    assert tune_job.main(["--config", str(cfg), "--set", "trials=3", "--set", "parallel=1"]) == 0
    trials = pd.read_parquet(out / "trials.parquet").sort_values("trial")
    assert list(trials["trial"]) == [0, 1, 2] and set(trials["state"]) == {"COMPLETE"}
    assert {n: (out / "trials" / f"trial_{n}" / "train" / "summary.json").stat().st_mtime_ns for n in (0, 1)} == stamps
    assert trials["objective"].max() == pytest.approx(json.loads((out / "best.json").read_text())["value"])


def test_grid_dry_run_counts_the_grid(tmp_path, capsys):
    doc = tiny_tune(tmp_path, sampler="grid", trials=100, space={
        "train.lr": {"type": "float", "low": 0.01, "high": 0.03, "step": 0.01},
        "train.batch_size": {"type": "categorical", "choices": [16, 32]}})
    assert tune_job.main(["--config", str(_write(tmp_path / "g.yaml", doc)), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["trials"] == 6
    assert not (tmp_path / "tune").exists()


@pytest.mark.parametrize("space, needle", [
    ({"train.lr": {"type": "float", "low": 0.1, "high": 0.01}}, "low=0.1 must be below high=0.01"),
    ({"train.lr": {"type": "float", "low": 0.0, "high": 0.1, "log": True}}, "log scale needs low > 0"),
    ({"train.batch_size": {"type": "categorical", "choices": []}}, "non-empty list of choices"),
    ({"train.batch_size": {"type": "int", "low": 8, "high": 64, "step": 100}}, "step=100"),
    ({"train.lr": {"type": "float", "high": 0.1}}, "needs low and high"),
    ({"train.lr_typo": {"type": "float", "low": 0.01, "high": 0.1}}, "train.lr_typo"),
    ({"train.lr": {"type": "float", "low": -1.0, "high": 0.1}}, "space.train.lr=-1.0"),
    ({"workers": {"type": "int", "low": 1, "high": 4}}, "space.workers cannot be searched"),
    ({}, "empty search space"),
])
def test_bad_search_space_gives_one_line_exit_2_and_starts_nothing(tmp_path, capsys, space, needle):
    cfg = _write(tmp_path / "bad.yaml", tiny_tune(tmp_path, space=space))
    rc = tune_job.main(["--config", str(cfg)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error:") and needle in err, err
    assert not (tmp_path / "tune").exists()


def test_grid_sampler_needs_a_step_for_floats(tmp_path, capsys):
    cfg = _write(tmp_path / "g.yaml", tiny_tune(tmp_path, sampler="grid"))
    assert tune_job.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert "space.train.lr: the grid sampler needs choices or a step" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "tune").exists()


def test_shipped_tuning_spaces_are_valid():
    from pipeline.config import load_config
    from pipeline.studies.tune import TuneConfig, plan_tune

    configs = Path(__file__).resolve().parents[1] / "configs"
    files = sorted((configs / "tune").glob("*.yaml")) + [configs / "tune.yaml"]
    assert len(files) >= 3
    for f in files:
        plan = plan_tune(load_config(TuneConfig, f))
        assert plan["trials"] >= 2, f
