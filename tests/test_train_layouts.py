"""Issue 5 on the training side: 4 Horovod-on-Spark workers over a full-overlap layout and over a
disjoint layout finish the same number of processed samples (overlap epoch rule
E_overlap = ceil(E_target / C) from the manifest; validation every ceil(N / B_global) steps).

Four Horovod processes need four concurrent Spark task slots, so the runs are
``spark-submit --master local[4] jobs/train.py`` processes (the shards come from the shard
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


@pytest.mark.timeout(2400)
def test_full_overlap_and_disjoint_process_the_same_number_of_samples(spark, digits_dataset, tmp_path):
    full = shard_digits(spark, digits_dataset, tmp_path / "full", "full_overlap", 4)
    disj = shard_digits(spark, digits_dataset, tmp_path / "disjoint", "disjoint", 4)
    mf, md = json.loads(full.read_text()), json.loads(disj.read_text())
    assert mf["layout"]["copies"] == 4 and md["layout"]["copies"] == 1
    n = mf["n_train_samples"]
    assert md["n_train_samples"] == n
    # a local batch for which both layouts split evenly into whole steps (the rule's exact case)
    b = next(b for b in range(8, 129) if 4 * (min(w["rows"] for w in md["workers"]) // b) == n // b)
    epochs = 4
    summaries = {}
    for name, man in (("full", full), ("disjoint", disj)):
        out = tmp_path / f"train_{name}"
        r = _spark_submit(["--manifest", str(man), "--output", str(out), "--launcher", "horovod", "--epochs", str(epochs),
                           "--batch_size", str(b), "--progress", "false"])
        assert r.returncode == 0, r.stderr[-3000:]
        summaries[name] = json.loads((out / "summary.json").read_text())
    f, d = summaries["full"], summaries["disjoint"]
    assert f["workers"] == d["workers"] == 4
    assert f["overlap_epochs"] == math.ceil(epochs / 4) == 1 and d["overlap_epochs"] == epochs
    assert f["samples_processed"] == d["samples_processed"] == 4 * b * f["steps"]
    assert f["steps"] == d["steps"] == epochs * (n // (4 * b))
    assert f["eval_every"] == d["eval_every"] == math.ceil(n / (4 * b))
    for s in (f, d):
        assert len(set(s["final_digests"])) == 1 and s["test_accuracy"] > 0.1
