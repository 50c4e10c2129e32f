"""Every collective gets tensors on its communicator's device, for every registered algorithm.

A NCCL world reads only CUDA memory, so a collective handed a host tensor (a centre kept on the
CPU, a distance computed after ``.cpu()``) breaks a GPU run. Each communicator declares its
device and refuses any other in one line (``DeviceMismatch``). The check runs here on the CPU:

* the synchronous algorithms on a model on ``meta`` in a world of identical replicas declared on
  ``meta`` (``LocalCommunicator(replicas, device="meta")``): no kernel runs, every collective's
  tensors are checked;
* the asynchronous algorithms in real processes (gloo) whose world communicator is declared on
  ``meta`` while the models are on the CPU: their host traffic (centre, metrics, group averages)
  must go through the host communicator (``comm.host()``), never through the device one.
"""
from __future__ import annotations

import pytest
import torch

from async_fixtures import results, run_procs
from pipeline.train.algorithms import REGISTRY
from pipeline.train.algorithms.async_common import ASYNC_ALGORITHMS
from pipeline.train.comm import DeviceMismatch
from pipeline.train.comm.local import LocalCommunicator

META = torch.device("meta")
SYNC_CASES = {   # every registered synchronous algorithm, with parameters that communicate within 4 steps
    "arsgd": {}, "local_sgd": {"period": 2}, "post_local_sgd": {"period": 2, "switch_step": 2},
    "hierarchical": {"household_period": 1, "neighbourhood_period": 2, "world_period": 4, "household_size": 1,
                     "neighbourhood_size": 2},
    "slowmo": {"base": "swarm", "base_params": {"local_steps": 1}, "tau": 2},
    "swarm": {"local_steps": 1}, "dpsgd": {"topology": "ring", "uniform_allreduce": False},
    "easgd": {"tau": 2}, "timed_local_sgd": {"round_seconds": 1e-6, "nominal_steps": 1},
}
ASYNC_CASES = {
    "adpsgd": {}, "eawild": {"alpha": 0.2}, "eawild_locked_groups": {"alpha": 0.2, "lock": True, "group_size": 2},
    "async_ps": {},
}


def test_every_registered_algorithm_is_checked():
    assert set(SYNC_CASES) | set(ASYNC_ALGORITHMS) == set(REGISTRY)


def test_a_collective_with_a_tensor_on_another_device_is_refused_in_one_line():
    comm = LocalCommunicator(replicas=3, device="meta")
    ok, host = torch.zeros(4, device=META), torch.zeros(4)
    comm.allreduce_mean_([ok])
    for call in (lambda: comm.allreduce_mean_([ok, host]), lambda: comm.broadcast_([host]),
                 lambda: comm.exchange([host], 1), lambda: comm.allgather_(host)):
        with pytest.raises(DeviceMismatch) as e:
            call()
        assert "\n" not in str(e.value) and "cpu" in str(e.value) and "meta" in str(e.value), str(e.value)
    assert comm.host().device == torch.device("cpu")


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("name", sorted(SYNC_CASES))
def test_a_synchronous_algorithm_keeps_every_collective_on_the_device(name):
    from pipeline.train.algorithms import BuildContext, build_algorithm
    from pipeline.train.algorithms.averaging import ModelAverager
    from pipeline.train.consensus import averaged_parameters, squared_distance

    comm = LocalCommunicator(replicas=4, device="meta")
    model = _model().to(META)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ctx = BuildContext(model, opt, comm, ModelAverager(model, opt, comm, "average", "average"),
                       groups=[{} for _ in range(4)], seed=3)
    algo = build_algorithm(name, SYNC_CASES[name], ctx)
    algo.on_start()
    for _ in range(4):
        algo.zero_grad()
        model(torch.zeros(16, 4, device=META)).sum().backward()
        algo.step()
    params = [p.data for p in model.parameters()]
    assert squared_distance(params, comm).device == META
    with averaged_parameters(params, comm):
        pass
    for tensors in [algo.evaluation_tensors() or []] + list(algo.extra_evaluations().values()):
        assert all(t.device == META for t in tensors)
    algo.in_sync()
    algo.state_dict()


def _async(rank, world, name, params):
    """An asynchronous algorithm whose world communicator is declared on meta (models on the CPU)."""
    from pipeline.train.algorithms import BuildContext, build_algorithm
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator(device="meta")
    model = torch.nn.Linear(6, 3).double()
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    algo = build_algorithm(name.split("_locked")[0], {**params, "round_steps": 3, "timeout_s": 20},
                           BuildContext(model, opt, comm, None, seed=1))
    algo.on_start()
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        algo.zero_grad()
        model(torch.randn(8, 6, generator=g, dtype=torch.float64)).pow(2).mean().backward()
        algo.step()
    metrics = algo.eval_metrics()
    extra = {k: len(v) for k, v in algo.extra_evaluations().items()}
    own = algo.evaluation_tensors()
    algo.on_finish()
    state = algo.state_dict()
    algo.close()
    return {"metrics": sorted(metrics), "extra": extra, "own": own is not None, "state": sorted(state)}


@pytest.mark.cluster
@pytest.mark.parametrize("case", sorted(ASYNC_CASES))
def test_an_asynchronous_algorithm_sends_host_tensors_only_through_the_host_communicator(case):
    res = results(run_procs(_async, 4, case, ASYNC_CASES[case], timeout=180))
    assert all("staleness_hist" in r["metrics"] for r in res)
    if case.startswith("eawild"):
        assert all(r["extra"] == {"centre": 2} for r in res)
