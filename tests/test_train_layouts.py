"""Overlap layouts: a full-overlap and a disjoint layout of 4 workers plan the same number of
processed samples (overlap epoch rule E_overlap = ceil(E_target / C) from the manifest;
validation every ceil(N / B_global) steps), and a real 4-worker Horovod-on-Spark run follows
its plan.

Four Horovod processes need four concurrent Spark task slots, so the run is a
``spark-submit --master local[4] jobs/train.py`` process (the shards come from the shard
stage on the shared local[2] session).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train_fixtures import shard_digits

pytest_plugins = ["train_fixtures"]
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


def _spark_submit(args: list[str], timeout: int = 1200) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[4]", "--driver-memory", "2g",
           "--conf", f"spark.pyspark.python={sys.executable}", "jobs/train.py", *args]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# slow (about 35 s): four Horovod processes (each imports torch) under a spark-submit of their own on 2 cores;
# a local batch of 32 or more keeps its steps few
@pytest.mark.timeout(2400)
@pytest.mark.needs_horovod
def test_layouts_plan_the_same_samples_and_a_four_worker_run_follows_the_plan(spark, digits_dataset, tmp_path):
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import plan_train

    full = shard_digits(spark, digits_dataset, tmp_path / "full", "full_overlap", 4)
    disj = shard_digits(spark, digits_dataset, tmp_path / "disjoint", "disjoint", 4)
    mf, md = json.loads(full.read_text()), json.loads(disj.read_text())
    assert mf["layout"]["copies"] == 4 and md["layout"]["copies"] == 1
    n = mf["n_train_samples"]
    assert md["n_train_samples"] == n
    # a local batch for which both layouts split evenly into whole steps (the rule's exact case), from 32
    # up: the 4-worker run below takes fewer, larger steps than at a batch from 8 up
    b = next(b for b in range(32, 129) if 4 * (min(w["rows"] for w in md["workers"]) // b) == n // b)
    epochs = 4
    plans = {name: plan_train(TrainConfig(manifest=str(man), output=str(tmp_path / name), epochs=epochs,
                                          batch_size=b))
             for name, man in (("full", full), ("disjoint", disj))}
    f, d = plans["full"], plans["disjoint"]
    assert f["workers"] == d["workers"] == 4
    assert f["overlap_epochs"] == math.ceil(epochs / 4) == 1 and d["overlap_epochs"] == epochs
    assert f["total_steps"] == d["total_steps"] == epochs * (n // (4 * b))
    assert f["eval_every"] == d["eval_every"] == math.ceil(n / (4 * b))
    # one real run of the plan: 4 Horovod workers through spark-submit on the full-overlap layout
    out = tmp_path / "train_full"
    r = _spark_submit(["--manifest", str(full), "--output", str(out), "--launcher", "horovod", "--epochs", str(epochs),
                       "--batch_size", str(b), "--progress", "false"])
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == 4 and s["steps"] == f["total_steps"] and s["overlap_epochs"] == 1, (b, s["steps"])
    assert s["samples_processed"] == 4 * b * s["steps"] == epochs * 4 * b * (n // (4 * b))
    assert len(set(s["final_digests"])) == 1  # AR-SGD: the four workers end with one model
    val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [rec for rec in val if rec.get("split") == "val"]
    every, total = f["eval_every"], f["total_steps"]
    assert [rec["step"] for rec in val] == [k for k in range(every, total, every)] + [total]  # always the last step
    assert val[-1]["loss"] < val[0]["loss"]  # it learned: validation loss fell over the run
