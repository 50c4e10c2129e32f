"""Not only local[*]: a Spark standalone cluster on localhost (a master and two 1-core workers that
share the driver's disk, tests/cluster_fixtures.py) runs a 2-worker Horovod training through
``spark-submit jobs/train.py --master spark://...``; then it is stopped. (The cluster whose workers
share no disk with the driver, with TorchDistributor and Horovod: tests/test_cluster_isolated.py.)"""
from __future__ import annotations

import json

import pytest
import torch

from cluster_fixtures import standalone_cluster

pytest_plugins = ["train_fixtures"]
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def standalone(tmp_path):
    with standalone_cluster(tmp_path / "cluster", isolated=False) as cluster:
        yield cluster


# slow (about 50 s): a standalone cluster (a master and two worker JVMs), one spark-submit whose executors
# start two Horovod processes; the same run in one process takes seconds of it
@pytest.mark.timeout(2400)
@pytest.mark.needs_horovod
def test_two_worker_horovod_training_on_a_standalone_cluster_equals_the_run_in_one_process(standalone,
                                                                                           digit_shards_2, tmp_path):
    """Horovod-on-Spark through ``spark-submit --master spark://...``, the output on the disk the
    driver and workers share: the model equals the same seeded AR-SGD run in this process
    (``inprocess_reference``). TorchDistributor on a cluster is compared
    with the same in-process run in tests/test_cluster_isolated.py (its training test), so the two
    launchers agree through it."""
    from pipeline.train.config import TrainConfig
    from train_fixtures import inprocess_reference

    args = {"max_steps": 6, "epochs": 1, "batch_size": 16, "progress": False}
    out = tmp_path / "train_horovod"
    r = standalone.submit("jobs/train.py", "--manifest", str(digit_shards_2), "--output", str(out),
                          "--launcher", "horovod", *[x for k, v in args.items() for x in (f"--{k}", str(v).lower())])
    assert r.returncode == 0, r.stderr[-3000:] + standalone.executor_logs()
    s = json.loads((out / "summary.json").read_text())
    assert s["launcher"] == "horovod" and s["workers"] == 2 and s["steps"] == 6
    assert len(set(s["final_digests"])) == 1
    ref = inprocess_reference(TrainConfig(manifest=str(digit_shards_2), output=str(tmp_path / "ref"), **args))
    assert ref["steps"] == 6
    got = torch.load(out / "model.pt", weights_only=False)["model"]
    want = torch.load(tmp_path / "ref" / "model.pt", weights_only=False)["model"]
    for k, v in want.items():
        assert torch.allclose(v, got[k], atol=1e-6), k
