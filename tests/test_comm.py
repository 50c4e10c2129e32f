"""The communication layer on real backends: Horovod-on-Spark and TorchDistributor (gloo), 2 processes;
and the fusion buckets' host staging (one host buffer per bucket) in this process.

The worker side is ``pipeline.train.selfcheck`` (tiny seeded tensors, the real communicators);
the launches happen once per session (``train_fixtures``) and the tests assert on the results.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.train.comm.fusion import HostStaging, make_buckets

pytest_plugins = ["train_fixtures"]


@pytest.fixture(params=[pytest.param("horovod", marks=pytest.mark.needs_horovod), "torch"])
def ranks(request):
    return request.getfixturevalue(f"{request.param}_checks")


@pytest.mark.cluster
def test_fused_allreduce_groups_broadcast_allgather(ranks):
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        c = r["comm"]
        assert c["allreduce_err"] < 1e-12  # 3 tensors, 2 dtypes, several 256-byte buckets
        assert c["pair_allreduce_err"] < 1e-12 and c["single_allreduce_err"] < 1e-12
        assert c["broadcast_err"] == 0.0
        assert c["allgather"] == [{"rank": 0}, {"rank": 1}]
        assert c["stats"]["bytes_sent"] > 0 and c["stats"]["comm_calls"] >= 5


@pytest.mark.cluster
def test_pairwise_exchange(ranks):
    for r in ranks:
        assert r["comm"]["exchange_err"] == 0.0
        assert r["comm"]["partial_exchange_err"] == 0.0


@pytest.mark.cluster
@pytest.mark.needs_horovod
def test_backends_give_the_same_parameters(horovod_checks, torch_checks):
    h = np.array(horovod_checks[0]["seeded_run"]["params"])
    t = np.array(torch_checks[0]["seeded_run"]["params"])
    assert h.shape == t.shape and h.size > 50
    assert np.allclose(h, t, rtol=0, atol=1e-6), float(np.abs(h - t).max())
    for ranks in (horovod_checks, torch_checks):  # and every rank ends with the same parameters
        assert len(set(ranks[0]["seeded_run"]["digests"])) == 1


# after two steps from the same start with different data per rank (selfcheck.ONE_STEP_PARAMS)
AGREE = {"arsgd", "local_sgd", "post_local_sgd", "slowmo", "swarm", "hierarchical"}  # averaged at step 2
APART = {"dpsgd", "easgd", "timed_local_sgd"}                                       # no exact average yet


@pytest.mark.cluster
def test_every_algorithm_moves_and_the_ranks_agree_exactly_when_they_averaged(ranks):
    steps = [r["one_step"] for r in ranks]
    for name in sorted(AGREE | APART):
        got = [s[name] for s in steps]
        assert all("error" not in g for g in got), (name, got)
        assert all(g["moved"] > 1e-4 for g in got), name
        digests = {g["digest"] for g in got}
        if name in AGREE:
            assert len(digests) == 1, name
        else:
            assert len(digests) == len(ranks) and not any(g["in_sync"] for g in got), name
        if all(g["in_sync"] for g in got):
            assert len(digests) == 1, name


def test_host_staging_uses_one_reused_host_buffer_per_bucket():
    ts = [torch.full((100,), float(i)) for i in range(10)] + [torch.arange(30, dtype=torch.float64)]
    st = HostStaging(pin=False, devices=("cpu",))  # stage CPU tensors here, as CUDA ones are staged on a GPU host
    buckets = make_buckets(ts, 1000, st)  # 400-byte float32 tensors: 2 per 1000-byte bucket, + 1 float64 bucket
    assert len(buckets) == 6 and st.allocations == 6
    assert [b.flat.numel() for b in buckets] == [200] * 5 + [30]
    for b in buckets:
        assert b.staged and all(b.flat.data_ptr() != t.data_ptr() for t in b.tensors)
        b.flat.mul_(2)  # what the collective does to the host buffer
        b.unpack_()
    assert all(torch.equal(t, torch.full((100,), 2.0 * i)) for i, t in enumerate(ts[:10]))
    assert torch.equal(ts[10], 2 * torch.arange(30, dtype=torch.float64))
    make_buckets(ts, 1000, st)
    assert st.allocations == 6  # the next collective reuses the same buffers
    cuda_only = HostStaging(pin=False)  # the production setting: CPU tensors are not staged
    assert not any(b.staged for b in make_buckets(ts, 1000, cuda_only)) and cuda_only.allocations == 0


@pytest.mark.needs_horovod
def test_a_horovod_tasks_gpu_is_read_through_horovods_public_api():
    """The GPU Spark assigned to a Horovod-on-Spark task, as Horovod's task service records it
    (horovod.spark.task.task_info.set_resources / get_available_devices, no private attribute)."""
    from horovod.spark.task import task_info
    from pyspark.resource import ResourceInformation

    from pipeline.train.gpus import task_gpu

    try:
        task_info.set_resources({"gpu": ResourceInformation("gpu", ["3"])})
        assert task_gpu() == 3
        task_info.set_resources({})
        assert task_gpu() is None   # no Horovod resources and no Spark task here
    finally:
        task_info.set_resources({})
