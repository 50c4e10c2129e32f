"""Training fed by the Petastorm engine (``loader.engine: petastorm``) under every launcher. The
local launcher runs a short 2-worker AR-SGD training on the shard stage's shards of the real
scikit-learn digits: the workers stay in step and the model learns. Under both Spark launchers
(Horovod-on-Spark, TorchDistributor) the HLF classifier trained through Petastorm stays in step and
reaches the native engine's test accuracy, within the spread between two seeds of the native
engine."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.train.config import TrainConfig
from pipeline.train.launch import train
from pipeline.train.metrics import read_metrics

pytest_plugins = ["train_fixtures"]
pytestmark = [pytest.mark.needs_petastorm, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("launcher", ["local"])   # the Spark launchers: the HLF test below
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


@pytest.fixture(scope="module")
def hlf_shards(spark, tmp_path_factory):
    """A dataset in the HLF contract (14 floats, 3 classes whose means differ by 0.35 per feature:
    learnable, far from separable) with a unit scaling.json beside it, cut by the shard stage for 2
    workers in row groups of 256."""
    from pipeline.features.scaling import ScalingFile
    from pipeline.shards.materialize import ShardConfig, shard

    root = tmp_path_factory.mktemp("hlf")
    rng = np.random.default_rng(0)
    n = 6000
    y = rng.integers(0, 3, n)
    x = (rng.normal(size=(n, 14)) + 0.35 * y[:, None]).astype(np.float32)
    split = np.where(np.arange(n) < 4800, "train", np.where(np.arange(n) < 5400, "test", "val"))
    (root / "features" / "hlf").mkdir(parents=True)
    pq.write_table(pa.table({"sample_id": np.arange(n, dtype=np.int64), "label": y.astype(np.int64), "split": split,
                             "hlf": pa.array(list(x), pa.list_(pa.float32()))}),
                   root / "features" / "hlf" / "part-0.parquet")
    (root / "features" / "scaling.json").write_text(ScalingFile(
        hlf={"mean": [0.0] * 14, "std": [1.0] * 14}, llf={"mean": [0.0] * 19, "std": [1.0] * 19}).model_dump_json())
    shard(ShardConfig(input=str(root / "features" / "hlf"), output=str(root / "shards"), workers=2, seed=0,
                      row_group_rows=256), spark)
    return root / "shards" / "manifest.json"


def _hlf_run(spark, manifest, out, launcher: str, engine: str, seed: int) -> dict:
    return train(TrainConfig(manifest=str(manifest), output=str(out), model="hlf", launcher=launcher, epochs=8,
                             batch_size=64, optimizer="sgd", lr=0.05, seed=seed, progress=False, max_restarts=0,
                             loader={"engine": engine}, debug={"record_param_digests": engine == "petastorm"}), spark)


@pytest.fixture(scope="module")
def native_hlf_accuracy(spark, hlf_shards, tmp_path_factory) -> list[float]:
    """The native engine's test accuracy at seeds 1 and 2 (the 2 workers as ranks of this process:
    the same AR-SGD arithmetic as under the Spark launchers, without starting a process)."""
    root = tmp_path_factory.mktemp("native")
    return [_hlf_run(spark, hlf_shards, root / str(seed), "inprocess", "native", seed)["test_accuracy"]
            for seed in (1, 2)]


# slow (20-30 s each): a Spark launcher's two worker processes reading through Petastorm for 8 epochs, the
# least that separates a working reader from chance (the reference runs in this process)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("launcher", [pytest.param("horovod", marks=pytest.mark.needs_horovod), "torch"])
def test_hlf_through_petastorm_reaches_the_native_engines_accuracy(launcher, spark, hlf_shards, native_hlf_accuracy,
                                                                   tmp_path):
    native = native_hlf_accuracy
    s = _hlf_run(spark, hlf_shards, tmp_path / "petastorm", launcher, "petastorm", 1)
    assert s["launcher"] == launcher
    r0, r1 = s["ranks"]
    assert r0["digests"] == r1["digests"] and len(r0["digests"]) == s["steps"]     # in step through Petastorm
    assert min(native) > 0.6                        # chance is 1/3; the classes' overlap allows about 0.66
    # within the native engine's seed-to-seed spread, at least the test split's binomial error (600 rows)
    spread = max(max(native) - min(native), 0.02)
    assert min(native) - spread <= s["test_accuracy"] <= max(native) + spread, (s["test_accuracy"], native)
