"""Helpers of the decentralized-training tests: start real worker processes, and the worker
functions that exercise SwarmSGD / D-PSGD / EASGD / consensus distance on a real backend.

* :func:`run_torch_workers` spawns M processes joined by torch.distributed (gloo), like the
  training stage's local launcher.
* :func:`run_horovod_workers` runs M Horovod (gloo) processes with ``horovod.run`` on this
  host (``horovod.spark.run`` would need M Spark task slots; the test session has 2).

The worker functions return plain numpy data; the tests assert in the parent (against values
computed there independently, never by re-running the code under test).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import numpy as np

from pipeline.train.comm.ports import free_port

def _torch_child(fn, rank, world, port, args, queue):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "PIPELINE_RUN_SECRET": f"test run {port:05d} " * 4})   # as a launcher hands out
    try:
        queue.put((rank, fn("torch", *args), None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_torch_workers(fn: Callable, world: int, *args: Any, timeout: float = 240) -> list:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
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


def _swarm_checks(comm, out: dict, topology: str, rounds: int, steps: int) -> None:
    """SwarmSGD pairwise averaging on this rank (section 1)."""
    import torch

    from pipeline.train.algorithms.swarm import SwarmSGD

    rank = comm.rank
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


def _dpsgd_checks(comm, out: dict, topology: str, rounds: int, steps: int) -> None:
    """D-PSGD mixing, complete-graph and adapt-then-combine equivalences (sections 2-4)."""
    import torch

    from pipeline.train.algorithms.arsgd import ARSGD
    from pipeline.train.algorithms.dpsgd import DPSGD

    rank, world = comm.rank, comm.world_size
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


def _easgd_checks(comm, out: dict, topology: str, rounds: int, steps: int) -> None:
    """EASGD through its own step() (section 5)."""
    import torch

    from pipeline.train.algorithms.easgd import EASGD

    rank = comm.rank
    # 5. EASGD through its own step(): the state just before each elastic step is recorded by a
    #    wrapper, the parent computes the expected update (sum_i x_i + centre invariant, beta = M * alpha)
    e = _net(500 + rank)
    oe = torch.optim.SGD(e.parameters(), lr=0.05)
    ea = EASGD(e.parameters(), oe, comm, tau=2, alpha=0.2)
    elastic = ea.elastic_step
    pre: list = []

    def recording_elastic_step():
        pre.append((_flat(e), ea.centre.numpy().copy()))
        elastic()

    ea.elastic_step = recording_elastic_step
    recs = []
    for s in range(6):
        _loss_step(e, rank, s)
        n_pre = len(pre)
        ea.step()
        stepped = len(pre) > n_pre
        recs.append((pre[-1][0] if stepped else _flat(e), pre[-1][1] if stepped else ea.centre.numpy().copy(),
                     _flat(e), ea.centre.numpy().copy(), stepped))
    out["easgd"] = recs


def _seed_and_slowmo_checks(comm, out: dict, topology: str, rounds: int, steps: int) -> None:
    """The run seed in SwarmSGD and SlowMo x0 after the broadcast (sections 7-8)."""
    import torch

    from pipeline.train.algorithms import BuildContext, build_algorithm
    from pipeline.train.algorithms.decentral import ParamsOnly
    from pipeline.train.algorithms.local_sgd import LocalSGD
    from pipeline.train.algorithms.slowmo import SlowMo

    rank = comm.rank
    # 7. the run seed reaches SwarmSGD through the registry: matchings of seeds 1, 2, 1
    out["seeded_partners"] = {}
    for tag, seed in (("a", 1), ("b", 2), ("a2", 1)):
        m = _net(1000 + rank)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        algo = build_algorithm("swarm", {"local_steps": 1, "topology": topology},
                               BuildContext(m, opt, comm, None, seed=seed))
        out["seeded_partners"][tag] = [algo.communicate() for _ in range(8)]

    # 8. SlowMo built BEFORE rank 0's weights are broadcast, ranks seeded differently: x0 must still
    #    be the broadcast weights (captured in on_start). Record init, pre-outer and post-outer.
    m = _net(1100 + rank)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    base = LocalSGD(m.parameters(), opt, comm, ParamsOnly(list(m.parameters()), comm), period=1000)
    sm = SlowMo(base, ParamsOnly(list(m.parameters()), comm), tau=2, beta=0.5, alpha=0.5)
    comm.broadcast_([p.data for p in m.parameters()], root=0)
    sm.on_start()
    init = _flat(m)
    outer = sm.outer_step
    slow: dict = {}

    def recording_outer_step():
        slow["pre"] = _flat(m)
        outer()
        slow["post"] = _flat(m)

    sm.outer_step = recording_outer_step
    for s in range(2):
        _loss_step(m, rank, s)
        sm.step()
    out["slowmo_x0"] = {"init": init, **slow}


def algorithm_checks(backend: str, topology: str = "complete", rounds: int = 12, steps: int = 5,
                     time_budget: bool = False) -> dict:
    """Run every algorithm-level check on this rank; return what the parent asserts on."""
    import torch

    from pipeline.train.comm import make_communicator
    from pipeline.train.consensus import consensus_distance

    torch.set_num_threads(1)
    comm = make_communicator(backend)
    rank, world = comm.rank, comm.world_size
    out: dict[str, Any] = {"rank": rank, "world": world}
    _swarm_checks(comm, out, topology, rounds, steps)
    _dpsgd_checks(comm, out, topology, rounds, steps)
    _easgd_checks(comm, out, topology, rounds, steps)
    # 6. consensus distance of different models
    f = _net(600 + rank)
    out["consensus"] = {"x": _flat(f), "d": consensus_distance(list(f.parameters()), comm)}
    out["exchange_calls"] = comm.stats.calls

    _seed_and_slowmo_checks(comm, out, topology, rounds, steps)
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


def time_budget_checks(comm, rounds: int = 6, round_seconds: float = 0.35, slow_rank: int = 0) -> dict:
    """Time-budgeted SwarmSGD (step-weighted), time-budgeted local SGD (step-weighted) and SlowMo
    (tau in rounds) around time-budgeted SwarmSGD, with worker ``slow_rank`` 3x slower."""
    import time

    import torch

    from pipeline.train.algorithms.decentral import ParamsOnly
    from pipeline.train.algorithms.timed_local_sgd import TimedLocalSGD
    from pipeline.train.algorithms.slowmo import slowmo_for
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
    sm.averager = ParamsOnly(list(m.parameters()), comm)
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


REGISTRY_CASES = {
    "swarm": ({"local_steps": 2}, "SwarmSGD"),
    "dpsgd": ({}, "DPSGD"),
    "easgd": ({"tau": 2}, "EASGD"),
    "timed_local_sgd": ({"round_seconds": 60.0}, "TimedLocalSGD"),
    "slowmo_dpsgd": ({"base": "dpsgd", "tau": 2}, "SlowMo"),
    "slowmo_easgd_no_average": ({"base": "easgd", "tau": 2, "average": False}, "SlowMo"),
    "slowmo_swarm": ({"base": "swarm", "base_params": {"local_steps": 2}, "tau": 4}, "SlowMo"),
    "slowmo_timed_swarm": ({"base": "swarm", "base_params": {"schedule": "time", "round_seconds": 60.0}, "tau": 2},
                           "RoundSlowMo"),
}


def registry_checks(backend: str, steps: int = 4) -> dict:
    """Build every case of REGISTRY_CASES through the registry (BatchNorm model, averaging policy
    average/reset), take ``steps`` steps from the same start with per-rank data; return the type,
    whether the parameters moved, ``in_sync`` and the parameters (the parent compares ranks)."""
    import torch

    from pipeline.train.algorithms import BuildContext, build_algorithm
    from pipeline.train.algorithms.averaging import ModelAverager
    from pipeline.train.comm import make_communicator

    torch.set_num_threads(1)
    comm = make_communicator(backend)
    out: dict[str, Any] = {"rank": comm.rank}
    for case, (params, _) in REGISTRY_CASES.items():
        name = "slowmo" if case.startswith("slowmo") else case
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ctx = BuildContext(model, opt, comm, ModelAverager(model, opt, comm, "average", "reset"), seed=3)
        algo = build_algorithm(name, params, ctx)
        algo.on_start()
        start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        g = torch.Generator().manual_seed(77 + comm.rank)
        for _ in range(steps):
            algo.zero_grad()
            model(torch.randn(16, 4, generator=g)).pow(2).mean().backward()
            algo.step()
        x = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[case] = {"type": type(algo).__name__, "moved": float((x - start).abs().max()),
                     "in_sync": bool(algo.in_sync()), "x": x.numpy().copy()}
    comm.shutdown()
    return out


def torch_backend_in_use(backend: str, device_kind: str = "cpu") -> str:
    """The torch.distributed backend a ``backend`` communicator for ``device_kind`` tensors initialised."""
    import torch.distributed as dist

    from pipeline.train.comm import make_communicator

    comm = make_communicator(backend, device_kind=device_kind)
    try:
        return str(dist.get_backend())
    finally:
        comm.shutdown()
