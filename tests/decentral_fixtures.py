"""Helpers of the decentralized-training tests: start real worker processes, and the worker
functions that exercise SwarmSGD / D-PSGD / EASGD / consensus distance on a real backend.

* :func:`run_torch_workers` spawns M processes joined by torch.distributed (gloo), like the
  training stage's local launcher.
* :func:`run_horovod_workers` runs M Horovod (gloo) processes with ``horovod.run`` on this
  host (``horovod.spark.run`` would need M Spark task slots; the test session has 2).

The worker functions return plain numpy data; the tests assert in the parent.
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_child(fn, rank, world, port, args, queue):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        queue.put((rank, fn("torch", *args), None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_torch_workers(fn: Callable, world: int, *args: Any, timeout: float = 240) -> list:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_torch_child, args=(fn, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, res, err = queue.get(timeout=timeout)
            results[rank] = res
            if err:
                errors.append(f"rank {rank}: {err}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


def run_horovod_workers(fn: Callable, world: int, *args: Any) -> list:
    import cloudpickle
    import horovod

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return horovod.run(fn, args=("horovod",) + tuple(args), np=world, hosts=f"localhost:{world}", use_gloo=True,
                       verbose=0)


# ----------------------------------------------------------------------------- worker functions
def _flat(model) -> np.ndarray:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _net(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _loss_step(model, rank: int, step: int):
    """A real gradient: squared output on seeded per-(rank, step) inputs."""
    import torch

    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(8, 6, generator=g)
    model.zero_grad()
    model(x).pow(2).mean().backward()


def algorithm_checks(backend: str, topology: str = "complete", rounds: int = 12, steps: int = 5,
                     time_budget: bool = False) -> dict:
    """Run every algorithm-level check on this rank; return what the parent asserts on."""
    import torch

    from pipeline.train.algorithms.arsgd import ARSGD
    from pipeline.train.algorithms.dpsgd import DPSGD
    from pipeline.train.algorithms.easgd import EASGD
    from pipeline.train.algorithms.swarm import SwarmSGD
    from pipeline.train.comm import make_communicator
    from pipeline.train.consensus import consensus_distance

    torch.set_num_threads(1)
    comm = make_communicator(backend)
    rank, world = comm.rank, comm.world_size
    out: dict[str, Any] = {"rank": rank, "world": world}

    # 1. SwarmSGD pairwise averaging: local SGD steps on different models, then communicate()
    m = _net(100 + rank)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    swarm = SwarmSGD(m.parameters(), opt, comm, local_steps=1, topology=topology, seed=5)
    pre, post, partners = [], [], []
    for r in range(rounds):
        _loss_step(m, rank, r)
        opt.step()
        pre.append(_flat(m))
        partners.append(swarm.communicate())
        post.append(_flat(m))
    out["swarm"] = {"pre": np.stack(pre), "post": np.stack(post), "partners": partners,
                    "matchings": [swarm.graph.matching(5, r) for r in range(rounds)]}

    # 2. one D-PSGD mixing step on the configured graph: post = W @ pre
    m = _net(200 + rank)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dp = DPSGD(m.parameters(), opt, comm, topology=topology, uniform_allreduce=False)
    x0 = _flat(m)
    dp.mix()
    out["mix"] = {"pre": x0, "post": _flat(m), "W": dp.W}

    # 3. D-PSGD with the complete-graph matrix (applied by pairwise exchanges) == parameter
    #    averaging by all-reduce followed by the local step (momentum SGD, real gradients)
    a, b = _net(300 + rank), _net(300 + rank)
    oa = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    dpa = DPSGD(a.parameters(), oa, comm, topology="complete", uniform_allreduce=False)
    assert not dpa.uniform and np.allclose(dpa.W, 1.0 / world)
    for s in range(steps):
        _loss_step(a, rank, s)
        dpa.step()
        _loss_step(b, rank, s)
        comm.allreduce_mean_([p.data for p in b.parameters()])
        ob.step()
    out["dpsgd_vs_allreduce"] = float(np.abs(_flat(a) - _flat(b)).max())
    out["dpsgd_spread"] = _flat(a)  # not identical across ranks (local gradients after mixing)

    # 4. D-PSGD adapt-then-combine, W = 1/M, plain SGD == AR-SGD (gradient averaging)
    c, d = _net(400), _net(400)  # same start on every rank
    oc = torch.optim.SGD(c.parameters(), lr=0.05)
    od = torch.optim.SGD(d.parameters(), lr=0.05)
    dpc = DPSGD(c.parameters(), oc, comm, topology="complete", order="atc", uniform_allreduce=False)
    ar = ARSGD(d.parameters(), od, comm)
    for s in range(steps):
        _loss_step(c, rank, s)
        dpc.step()
        _loss_step(d, rank, s)
        ar.step()
    out["atc_vs_arsgd"] = float(np.abs(_flat(c) - _flat(d)).max())
    out["atc_final"] = _flat(c)

    # 5. EASGD elastic steps: sum_i x_i + centre is invariant (beta = M * alpha)
    e = _net(500 + rank)
    oe = torch.optim.SGD(e.parameters(), lr=0.05)
    ea = EASGD(e.parameters(), oe, comm, tau=2, alpha=0.2)
    recs = []
    for s in range(6):
        _loss_step(e, rank, s)
        ea.before_step()
        oe.step()
        x_before = _flat(e)
        c_before = ea.centre.numpy().copy()
        if (ea.step_count + 1) % ea.tau == 0:
            ea.elastic_step()
        ea.step_count += 1
        recs.append((x_before, c_before, _flat(e), ea.centre.numpy().copy()))
    out["easgd"] = recs

    # 6. consensus distance of different models
    f = _net(600 + rank)
    out["consensus"] = {"x": _flat(f), "d": consensus_distance(list(f.parameters()), comm)}
    out["exchange_calls"] = comm.stats.calls
    if time_budget:
        out["time"] = time_budget_checks(comm)
    comm.shutdown()
    return out


def _recording(algo, log: list, model):
    """Wrap ``algo.communicate`` to record (round, steps in round, x before, x after, partner)."""
    inner = algo.communicate

    def communicate():
        h, before = algo.steps_in_round, _flat(model)
        partner = inner()
        log.append((algo.rounds_done, h, before, _flat(model), partner))
        return partner

    algo.communicate = communicate


def time_budget_checks(comm, rounds: int = 6, round_seconds: float = 0.12, slow_rank: int = 0) -> dict:
    """Time-budgeted SwarmSGD (step-weighted), time-budgeted local SGD (step-weighted) and SlowMo
    (tau in rounds) around time-budgeted SwarmSGD, with worker ``slow_rank`` 3x slower."""
    import time

    import torch

    from pipeline.train.algorithms.rounds import TimedLocalSGD, slowmo_for
    from pipeline.train.algorithms.swarm import SwarmSGD
    from pipeline.train.stragglers import StragglerConfig, StragglerSimulator

    rank = comm.rank
    sim = StragglerSimulator(StragglerConfig(slowdown={slow_rank: 3.0}), rank)
    out: dict[str, Any] = {"rank": rank}

    def train(algo, model, n_rounds):
        step = 0
        while algo.rounds_done < n_rounds:
            with sim.compute():
                _loss_step(model, rank, step)
                time.sleep(0.01)  # a compute step of at least 10 ms
            algo.step()
            step += 1
        return step

    m = _net(700 + rank)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sw = SwarmSGD(m.parameters(), opt, comm, schedule="time", round_seconds=round_seconds, weighting="steps",
                  topology="complete", seed=9)
    log: list = []
    _recording(sw, log, m)
    out["swarm_steps"] = train(sw, m, rounds)
    out["swarm_log"] = log
    assert sw.variable_steps

    m = _net(800 + rank)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    ls = TimedLocalSGD(m.parameters(), opt, comm, round_seconds=round_seconds, weighting="steps")
    log = []
    _recording(ls, log, m)
    train(ls, m, rounds)
    out["local_log"] = log

    m = _net(900)  # same start everywhere, as after the initial broadcast
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    base = SwarmSGD(m.parameters(), opt, comm, schedule="time", round_seconds=round_seconds, seed=9)
    sm = slowmo_for(base, None, tau=2, beta=0.5, alpha=1.0, average=True)
    sm.averager = _WorldAverager(comm, m)
    snaps = []
    while base.rounds_done < rounds:
        with sim.compute():
            _loss_step(m, rank, sm.step_count)
            time.sleep(0.01)
        sm.step()
        if base.round_finished:
            snaps.append((base.rounds_done, _flat(m)))
    out["slowmo"] = {"type": type(sm).__name__, "snaps": snaps}
    return out


class _WorldAverager:
    """Minimal ModelAverager (parameters only) for the SlowMo check."""

    momentum = "local"

    def __init__(self, comm, model):
        self.comm, self.params = comm, list(model.parameters())

    def tensors(self):
        return [p.data for p in self.params]

    def momentum_state(self):
        return []

    def average_(self, group=None):
        self.comm.allreduce_mean_(self.tensors(), group)
