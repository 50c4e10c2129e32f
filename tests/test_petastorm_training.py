"""Training fed by the Petastorm engine (``loader.engine: petastorm``) under every launcher:
Horovod-on-Spark, TorchDistributor and the local launcher each run a short 2-worker AR-SGD training
on the shard stage's shards of the real scikit-learn digits; the workers stay in step and the
model learns."""
from __future__ import annotations

import json

import pytest

from pipeline.train.config import TrainConfig
from pipeline.train.launch import train
from pipeline.train.metrics import read_metrics

pytest_plugins = ["train_fixtures"]
pytestmark = [pytest.mark.needs_petastorm, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("launcher", [pytest.param("horovod", marks=pytest.mark.needs_horovod), "torch", "local"])
def test_two_worker_training_through_petastorm_under_each_launcher(launcher, spark, digit_shards_2, tmp_path):
    out = tmp_path / "train"
    s = train(TrainConfig(manifest=str(digit_shards_2), output=str(out), launcher=launcher, epochs=2, batch_size=32,
                          optimizer="sgd", lr=0.05, progress=False, max_restarts=0, loader={"engine": "petastorm"},
                          debug={"record_param_digests": True}), spark)
    man = json.loads(digit_shards_2.read_text())
    spe = min(w["rows"] for w in man["workers"]) // 32
    assert s["launcher"] == launcher and s["workers"] == 2 and s["steps"] == 2 * spe
    assert s["samples_processed"] == 2 * s["steps"] * 32
    r0, r1 = s["ranks"]
    assert len(r0["digests"]) == s["steps"] and r0["digests"] == r1["digests"]   # in step after every step
    assert len(set(r0["digests"])) == s["steps"]                                # and every step moved them
    val = [r["loss"] for r in read_metrics(str(out / "metrics.jsonl")) if r["split"] == "val"]
    assert len(val) >= 2 and val[-1] < val[0]                                   # it learned
