"""The communication layer on real backends: Horovod-on-Spark and TorchDistributor (gloo), 2 processes.

The worker side is ``pipeline.train.selfcheck`` (tiny seeded tensors, the real communicators);
the launches happen once per session (``train_fixtures``) and the tests assert on the results.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest_plugins = ["train_fixtures"]
pytestmark = pytest.mark.cluster


@pytest.fixture(params=["horovod", "torch"])
def ranks(request, horovod_checks, torch_checks):
    return {"horovod": horovod_checks, "torch": torch_checks}[request.param]


def test_fused_allreduce_groups_broadcast_allgather(ranks):
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        c = r["comm"]
        assert c["allreduce_err"] < 1e-12  # 3 tensors, 2 dtypes, several 256-byte buckets
        assert c["pair_allreduce_err"] < 1e-12 and c["single_allreduce_err"] < 1e-12
        assert c["broadcast_err"] == 0.0
        assert c["allgather"] == [{"rank": 0}, {"rank": 1}]
        assert c["stats"]["bytes_sent"] > 0 and c["stats"]["comm_calls"] >= 5


def test_pairwise_exchange(ranks):
    for r in ranks:
        assert r["comm"]["exchange_err"] == 0.0
        assert r["comm"]["partial_exchange_err"] == 0.0


def test_backends_give_the_same_parameters(horovod_checks, torch_checks):
    h = np.array(horovod_checks[0]["seeded_run"]["params"])
    t = np.array(torch_checks[0]["seeded_run"]["params"])
    assert h.shape == t.shape and h.size > 50
    assert np.allclose(h, t, rtol=0, atol=1e-6), float(np.abs(h - t).max())
    for ranks in (horovod_checks, torch_checks):  # and every rank ends with the same parameters
        assert len(set(ranks[0]["seeded_run"]["digests"])) == 1


def test_every_algorithm_takes_a_step(ranks):
    for r in ranks:
        for name in ("arsgd", "local_sgd", "post_local_sgd", "hierarchical", "slowmo"):
            assert r["one_step"][name]["ok"], (name, r["one_step"][name])
