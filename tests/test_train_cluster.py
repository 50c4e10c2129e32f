"""Not only local[*]: a Spark standalone cluster on localhost (a master and two 1-core workers that
share the driver's disk, tests/cluster_fixtures.py) runs a 2-worker training through
``spark-submit jobs/train.py --master spark://...`` with each launcher; then it is stopped.
Both launchers train the same seeded AR-SGD run, so their final parameters agree. (The cluster whose
workers share no disk with the driver: tests/test_cluster_isolated.py.)"""
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


@pytest.mark.timeout(2400)
@pytest.mark.needs_horovod
def test_two_worker_training_on_a_standalone_cluster_with_each_launcher(standalone, digit_shards_2, tmp_path):
    params = {}
    for launcher in ("horovod", "torch"):
        out = tmp_path / f"train_{launcher}"
        r = standalone.submit("jobs/train.py", "--manifest", str(digit_shards_2), "--output", str(out),
                              "--launcher", launcher, "--max_steps", "6", "--epochs", "1", "--batch_size", "16",
                              "--progress", "false")
        assert r.returncode == 0, r.stderr[-3000:] + standalone.executor_logs()
        s = json.loads((out / "summary.json").read_text())
        assert s["launcher"] == launcher and s["workers"] == 2 and s["steps"] == 6
        assert len(set(s["final_digests"])) == 1
        params[launcher] = torch.load(out / "model.pt", weights_only=False)["model"]
    for k, v in params["horovod"].items():
        assert torch.allclose(v, params["torch"][k], atol=1e-6), k
