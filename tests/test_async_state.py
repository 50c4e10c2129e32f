"""Checkpoint state of the asynchronous algorithms: the EA-wild centre and the parameter
server's optimizer moments are saved and a resume continues from them (not from rank 0's model
and fresh moments); the state holds only tensors and plain data (``torch.load(weights_only=True)``).

Real processes joined by torch.distributed (gloo): a first algorithm runs two rounds and saves
its state; a fresh one (as after a restart) loads it and continues.
"""
from __future__ import annotations

import io
import time

import numpy as np
import pytest
import torch

from async_fixtures import results, run_procs, vector

pytestmark = pytest.mark.cluster


def _build(name: str, params: dict, x0: torch.Tensor, opt_cls, lr: float):
    from pipeline.train.algorithms import BuildContext, build_algorithm
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    model = torch.nn.Module()
    model.x = torch.nn.Parameter(x0.clone())
    opt = opt_cls(model.parameters(), lr=lr)
    algo = build_algorithm(name, params, BuildContext(model, opt, comm, None, seed=1))
    algo.on_start()
    return model.x, opt, algo


def _save_and_resume(rank, world, name, params, lr):
    opt_cls = torch.optim.Adam if name == "async_ps" else torch.optim.SGD
    x, opt, algo = _build(name, params, vector(0), opt_cls, lr)
    target = vector(10 + rank)
    for _ in range(2 * params["round_steps"]):
        x.grad = x.detach() - target
        algo.step()
        time.sleep(0.002)
    blob = io.BytesIO()
    torch.save({"algorithm": algo.state_dict(), "optimizer": opt.state_dict(), "x": x.detach().clone()}, blob)
    centre = algo.centre_flat().numpy().copy()
    algo.close()

    saved = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)   # only tensors and plain data
    x2, opt2, algo2 = _build(name, params, saved["x"], opt_cls, lr)       # a restart: model and optimizer restored
    opt2.load_state_dict(saved["optimizer"])
    algo2.load_state_dict(saved["algorithm"])
    out = {"centre": centre, "model": saved["x"].numpy(), "resumed_centre": algo2.centre_flat().numpy().copy(),
           "rounds_done": algo2.rounds_done,    # (numpy: tensors do not outlive the process through the queue)
           "server_state": {k: (v.numpy().copy() if torch.is_tensor(v) else v)
                            for k, v in (saved["algorithm"].get("server_state") or {}).items()}}
    if name == "async_ps":   # one more step each: the server's model after both pushes
        g = torch.full_like(x2, 0.5 * (rank + 1))
        x2.grad = g.clone()
        algo2.step()
        algo2.on_finish()   # ends the round: every worker takes the server's model (both pushes applied)
        out["after"] = x2.detach().numpy().copy()
    algo2.close()
    return out


def test_a_resumed_eawild_continues_from_the_saved_centre():
    world = 3
    res = results(run_procs(_save_and_resume, world, "eawild", {"alpha": 0.3, "round_steps": 5}, 0.05))
    for r in res:
        assert r["rounds_done"] == 2
        np.testing.assert_array_equal(r["resumed_centre"], r["centre"])
    assert float(np.abs(res[0]["centre"] - res[0]["model"]).max()) > 1e-3   # not rank 0's model


def _adam_server(c0: np.ndarray, state: dict, grads: list[np.ndarray], lr: float) -> np.ndarray:
    """torch's Adam from ``state`` (the saved moments, or none) applying ``grads`` in order."""
    p = torch.nn.Parameter(torch.from_numpy(c0.copy()))
    opt = torch.optim.Adam([p], lr=lr)
    if state:
        opt.state[p] = {k: torch.as_tensor(v).clone() for k, v in state.items()}
    for g in grads:
        p.grad = torch.from_numpy(g)
        opt.step()
    return p.detach().numpy()


def test_a_resumed_parameter_server_continues_with_the_saved_moments():
    """After the resume, each worker pushes one gradient: the server's model is torch's Adam
    applied from the SAVED moments (in one of the two push orders), not from fresh ones."""
    world, lr = 2, 0.05
    res = results(run_procs(_save_and_resume, world, "async_ps", {"round_steps": 3}, lr))
    c0 = res[0]["centre"]
    for r in res:
        assert r["rounds_done"] == 2
        np.testing.assert_array_equal(r["resumed_centre"], c0)
        np.testing.assert_array_equal(r["model"], c0)          # the workers hold the server's model
    moments = res[0]["server_state"]
    assert set(moments) >= {"exp_avg", "exp_avg_sq", "step"} and float(np.abs(moments["exp_avg"]).max()) > 0
    grads = [np.full_like(c0, 0.5 * (k + 1)) for k in range(world)]
    push_lr = lr / world ** 0.5
    after = res[0]["after"]
    saved = [_adam_server(c0, dict(moments), order, push_lr) for order in (grads, grads[::-1])]
    fresh = _adam_server(c0, {}, grads, push_lr)
    assert not np.allclose(saved[0], fresh, rtol=0, atol=1e-9)
    assert any(np.allclose(after, s, rtol=0, atol=1e-12) for s in saved), \
        [float(np.abs(after - s).max()) for s in saved]


@pytest.mark.parametrize("name", ["arsgd", "local_sgd", "post_local_sgd", "hierarchical", "slowmo", "swarm", "dpsgd",
                                  "easgd", "timed_local_sgd"])
def test_a_synchronous_algorithms_state_loads_with_weights_only(name):
    """Every algorithm's checkpoint state is tensors and plain data (here the synchronous ones, after a
    few steps in a world of identical replicas; the asynchronous ones above)."""
    from pipeline.train.algorithms import BuildContext, build_algorithm
    from pipeline.train.algorithms.averaging import ModelAverager
    from pipeline.train.comm.local import LocalCommunicator
    from test_comm_devices import SYNC_CASES

    comm = LocalCommunicator(replicas=4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algo = build_algorithm(name, SYNC_CASES[name], BuildContext(model, opt, comm,
                                                              ModelAverager(model, opt, comm, "average", "average"),
                                                              groups=[{} for _ in range(4)], seed=3))
    algo.on_start()
    for _ in range(4):
        algo.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        algo.step()
    blob = io.BytesIO()
    torch.save(algo.state_dict(), blob)
    state = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
    assert state["step_count"] == 4
    algo.load_state_dict(state)
