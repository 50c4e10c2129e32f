"""The communication cores of the asynchronous algorithms, without gradients, in real processes
joined by torch.distributed (gloo): AD-PSGD's pairwise averaging thread and the EA-wild centre
holder (lock-free and locked), including early leavers and a peer killed mid-run."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cluster

DIM = 257


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _child(fn, rank, world, port, q, args):
    try:
        _init(rank, world, port)
        q.put((rank, fn(rank, world, *args), None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, None, f"{type(e).__name__}: {e}"))


def run_procs(fn, world: int, *args, timeout: float = 90.0, expect: int | None = None):
    """Run fn(rank, world, *args) in ``world`` spawned processes; {rank: (result, error)} of those that reported."""
    from pipeline.train.comm.ports import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, q, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out, deadline = {}, time.time() + timeout
    try:
        while len(out) < (world if expect is None else expect):
            rank, res, err = q.get(timeout=max(0.1, deadline - time.time()))
            out[rank] = (res, err)
    except queue_mod.Empty:
        pytest.fail(f"processes hung: only ranks {sorted(out)} reported within {timeout} s")
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return out


def _vector(rank: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(rank).normal(size=DIM) * (rank + 1) + 3 * rank)


def _gather(x: torch.Tensor, world: int) -> np.ndarray:
    import torch.distributed as dist

    xs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(xs, x)
    return torch.stack(xs).numpy()


# ---------------------------------------------------------------------------- AD-PSGD
def _adpsgd(rank, world, slow, rounds, round_s, leave_after):
    from pipeline.train.algorithms.adpsgd import PairAveraging, adpsgd_pairs
    from pipeline.train.comm.p2p import P2PChannel

    x = _vector(rank)
    core = PairAveraging(P2PChannel(adpsgd_pairs(world), 20), [x], threading.Lock(), seed=3,
                         delay_s=0.01 if rank == slow else 0.0)
    snaps = [_gather(x, world)]
    for r in range(rounds):
        if r == leave_after.get(rank, -1):
            break
        core.begin_round()
        time.sleep(round_s)
        core.end_round(30)
        if not leave_after:
            snaps.append(_gather(x, world))
    core.leave(60)
    if leave_after:
        snaps.append(_gather(x, world))
    return {"snaps": snaps, "exchanges": core.stats.exchanges, "staleness": dict(core.stats.staleness)}


def _adpsgd_paced(rank, world, per_step, steps):
    """PairAveraging with its computation thread replaced by ``steps`` notifications 20 ms apart."""
    from pipeline.train.algorithms.adpsgd import PairAveraging, adpsgd_pairs
    from pipeline.train.comm.p2p import P2PChannel

    x = _vector(rank)
    core = PairAveraging(P2PChannel(adpsgd_pairs(world), 20), [x], threading.Lock(), seed=3, per_step=per_step)
    core.begin_round()
    for _ in range(steps):
        core.notify_step()
        time.sleep(0.02)
    core.end_round(30)
    core.leave(30)
    return core.stats.exchanges


def test_adpsgd_step_pace_starts_at_most_one_averaging_per_gradient_step():
    """pace "step": each active starts at most one averaging per notified step (and keeps up with
    20 ms steps); "free" averages back to back, many times per step, in the same time."""
    world, steps = 4, 25
    paced = run_procs(_adpsgd_paced, world, True, steps)
    free = run_procs(_adpsgd_paced, world, False, steps)
    assert all(err is None for _, err in list(paced.values()) + list(free.values())), (paced, free)
    for r in (0, 2):   # the actives: what they started
        assert steps // 2 <= paced[r][0] <= steps, paced[r][0]
        assert free[r][0] > 3 * steps, free[r][0]


def _consensus(xs: np.ndarray) -> float:
    return float(((xs - xs.mean(0)) ** 2).sum(1).mean())


@pytest.mark.parametrize("world,slow", [(2, 1), (3, 2), (4, 3)])
def test_adpsgd_keeps_the_mean_and_reaches_consensus_with_a_slow_worker(world, slow):
    out = run_procs(_adpsgd, world, slow, 3, 0.4, {})
    assert all(err is None for _, err in out.values()), out
    snaps = out[0][0]["snaps"]
    mean0 = snaps[0].mean(0)
    for s in snaps[1:]:
        np.testing.assert_allclose(s.mean(0), mean0, rtol=0, atol=1e-9)  # the pair's sum is preserved
    cds = [_consensus(s) for s in snaps]
    assert cds[0] > 10
    assert cds[1] < cds[0] * 1e-2 and cds[-1] < cds[0] * 1e-6, cds
    exchanges = [out[r][0]["exchanges"] for r in range(world)]
    assert all(e > 0 for e in exchanges), exchanges  # the slow worker takes part too
    # every averaging involves one active and one passive: the two sides count the same total
    assert sum(exchanges[0::2]) == sum(exchanges[1::2]), exchanges


@pytest.mark.parametrize("world,leave_after", [(3, {2: 1}), (4, {1: 1, 2: 2})])
def test_adpsgd_a_worker_that_stops_early_does_not_block_the_others(world, leave_after):
    out = run_procs(_adpsgd, world, -1, 3, 0.3, leave_after)
    assert all(err is None for _, err in out.values()), out
    snaps = out[0][0]["snaps"]
    np.testing.assert_allclose(snaps[-1].mean(0), snaps[0].mean(0), rtol=0, atol=1e-9)
    assert _consensus(snaps[-1]) < _consensus(snaps[0]) * 1e-3


def _adpsgd_killed(rank, world, victim, outdir):
    from pipeline.outputs import atomic_output_dir
    from pipeline.train.algorithms.adpsgd import PairAveraging, adpsgd_pairs
    from pipeline.train.comm.p2p import P2PChannel

    x = _vector(rank)
    core = PairAveraging(P2PChannel(adpsgd_pairs(world), 5), [x], threading.Lock(), seed=3)
    t0 = time.time()
    with atomic_output_dir(os.path.join(outdir, f"rank{rank}")) as tmp:
        for r in range(6):
            core.begin_round()
            time.sleep(0.2)
            if rank == victim and r == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            core.end_round(10)
            np.save(os.path.join(tmp, f"round{r}.npy"), x.numpy())
        core.leave(10)
    return time.time() - t0


def test_adpsgd_a_peer_killed_mid_run_fails_the_others_clearly(tmp_path):
    world, victim = 3, 1
    t0 = time.time()
    out = run_procs(_adpsgd_killed, world, victim, str(tmp_path), timeout=60, expect=world - 1)
    _survivors_failed_cleanly(out, world, victim, tmp_path, time.time() - t0, 45)


def _survivors_failed_cleanly(out: dict, world: int, victim: int, outdir, seconds: float, limit: float) -> None:
    """Every rank but the victim reported a PeerError naming its rank, within ``limit`` seconds,
    and wrote nothing (the killed process could not remove its own temporary directory)."""
    assert set(out) == set(range(world)) - {victim}
    for rank, (res, err) in out.items():
        assert res is None and err is not None, (rank, res)
        assert "PeerError" in err and f"rank {rank}" in err, err
    assert seconds < limit, seconds
    left = [p.name for p in outdir.iterdir() if not p.name.startswith(f".rank{victim}.")]
    assert left == [], left


# ---------------------------------------------------------------------------- EA-wild holder
def _eawild(rank, world, locked, seconds, alpha, slow):
    from pipeline.train.algorithms.async_common import AsyncStats
    from pipeline.train.algorithms.eawild import CentreHolder, CentreLink, centre_pairs, elastic_rule
    from pipeline.train.comm.p2p import P2PChannel

    ch = P2PChannel(centre_pairs(world), 20)
    x = _vector(rank)
    c0 = _vector(0)  # every worker starts from rank 0's vector; the centre too
    x.copy_(c0) if rank == 0 else None
    holder = CentreHolder(ch, c0, elastic_rule, DIM + 1, locked) if rank == 0 else None
    link = CentreLink(ch, holder, DIM, torch.float64, AsyncStats())
    link.begin_round()
    pulled = c0.clone()
    x0 = x.clone()

    def update(c):
        x.add_(x - c, alpha=-alpha)
        return torch.cat([x, torch.tensor([alpha], dtype=x.dtype)])

    pushes, t_end = 0, time.time() + seconds
    while time.time() < t_end:  # every worker pushes until the same wall-clock end; one is 5x slower
        if locked:
            link.locked_update(update)
        else:
            pulled = link.push(update(pulled))
        pushes += 1
        time.sleep(0.01 if rank == slow else 0.002)
    link.end_round(30)
    xs = _gather(x, world)
    link.leave(30)
    return {"pushes": pushes, "x0": _gather(x0, world), "x": xs, "c": None if holder is None else holder.c.numpy(),
            "order": None if holder is None else list(holder.order)}


def _replay(x0: np.ndarray, c0: np.ndarray, order: list[int], alpha: float):
    """Sequential (locked) asynchronous EASGD applied in ``order``."""
    x, c = x0.copy(), c0.copy()
    for j in order:
        x[j] = x[j] - alpha * (x[j] - c)
        c = c + alpha * (x[j] - c)
    return x, c


@pytest.mark.parametrize("locked", [False, True])
def test_eawild_centre_and_workers_converge_to_a_common_point(locked):
    world, alpha = 3, 0.2
    out = run_procs(_eawild, world, locked, 1.5, alpha, 2)
    assert all(err is None for _, err in out.values()), out
    r0 = out[0][0]
    x, c, order = r0["x"], r0["c"], r0["order"]
    pushes = [out[r][0]["pushes"] for r in range(world)]
    assert [order.count(r) for r in range(world)] == pushes, pushes
    assert pushes[2] > 20 and pushes[2] < min(pushes[:2]), pushes  # the 5x slower worker pushes less
    spread0 = float(np.abs(r0["x0"] - r0["x0"].mean(0)).max())
    assert spread0 > 1
    assert float(np.abs(x - c).max()) < 1e-3 * spread0, np.abs(x - c).max()
    if locked:  # the lock serialises pull-update-push: exactly sequential EASGD in the holder's grant order
        xr, cr = _replay(r0["x0"], r0["x0"][0], order, alpha)
        np.testing.assert_allclose(x, xr, rtol=0, atol=1e-12)
        np.testing.assert_allclose(c, cr, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------- EA-wild groups
def _eawild_grouped(rank, world, group_size, tau, alpha, rounds, round_steps, round_s, slow, lock=False):
    """EAWild itself (the world communicator, the group allreduce, the holder) on one vector, no gradients."""
    from pipeline.train.algorithms.eawild import EAWild
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    x = torch.nn.Parameter(_vector(rank))
    alg = EAWild([x], torch.optim.SGD([x], lr=0.0), comm, tau=tau, alpha=alpha, group_size=group_size,
                 lock=lock, round_steps=round_steps, round_seconds=round_s, timeout_s=30)
    x0 = _gather(x.detach().clone(), world)
    for _ in range(rounds):
        while True:
            alg.step()
            time.sleep(0.01 if rank == slow else 0.002)
            if alg.round_finished:
                break
    xs = _gather(x.detach().clone(), world)
    c = alg.centre_flat().numpy()
    holder = alg.holder
    out = {"x0": x0, "x": xs, "c": c, "steps": alg.step_count, "pushes": alg.stats.exchanges,
           "order": None if holder is None else list(holder.order),
           "served": None if holder is None else (holder.server is not None)}
    alg.close()
    return out


@pytest.mark.parametrize("lock", [False, True])
def test_eawild_groups_reach_a_common_point_with_the_centre(lock):
    """M = 4 in groups of 2 (time-mode rounds, one slow member): only the leaders 0 and 2 push, each
    group's members stay in step (same step count, same model), and all meet the centre; with the
    lock too (the leader's group allreduce inside its critical section on the holder)."""
    world = 4
    out = run_procs(_eawild_grouped, world, 2, 1, 0.2, 5, 40, 0.4, 3, lock)   # 5 rounds: converged under load too
    assert all(err is None for _, err in out.values()), out
    r0 = out[0][0]
    steps = [out[r][0]["steps"] for r in range(world)]
    pushes = [out[r][0]["pushes"] for r in range(world)]
    assert steps[0] == steps[1] and steps[2] == steps[3], steps  # synchronous within a group
    if not lock:  # the group with the slow member is slower, the other does not wait (with the lock it may)
        assert steps[2] < steps[0], steps
    assert pushes[1] == pushes[3] == 0 and pushes[0] == steps[0] and pushes[2] == steps[2], (pushes, steps)
    assert sorted(set(r0["order"])) == [0, 2] and [r0["order"].count(r) for r in (0, 2)] == [pushes[0], pushes[2]]
    spread0 = float(np.abs(r0["x0"] - r0["x0"].mean(0)).max())
    assert spread0 > 1
    x, c = r0["x"], r0["c"]
    np.testing.assert_allclose(x[1], x[0], rtol=0, atol=1e-12)  # a group leaves every exchange as one model
    np.testing.assert_allclose(x[3], x[2], rtol=0, atol=1e-12)
    assert float(np.abs(x - c).max()) < 1e-3 * spread0, np.abs(x - c).max()


def test_eawild_one_group_of_all_workers_is_one_pusher():
    """group_size = M: rank 0 alone updates the centre (in memory, no serving thread), once per tau steps."""
    world, tau, alpha, rounds, h = 3, 2, 0.3, 3, 6
    out = run_procs(_eawild_grouped, world, world, tau, alpha, rounds, h, None, -1)
    assert all(err is None for _, err in out.values()), out
    r0 = out[0][0]
    assert [out[r][0]["steps"] for r in range(world)] == [rounds * h] * world
    assert r0["order"] == [0] * (rounds * h // tau) and r0["served"] is False
    assert [out[r][0]["pushes"] for r in range(world)] == [rounds * h // tau, 0, 0]
    x, c, x0 = r0["x"], r0["c"], r0["x0"]
    # replay: x <- (1 - a) mean(x) + a c;  c <- c + a (x - c), from c = rank 0's start
    xm, cr = x0.mean(0), x0[0].copy()
    for _ in range(rounds * h // tau):
        xm = (1 - alpha) * xm + alpha * cr
        cr = cr + alpha * (xm - cr)
    np.testing.assert_allclose(x, np.stack([xm] * world), rtol=0, atol=1e-9)
    np.testing.assert_allclose(c, cr, rtol=0, atol=1e-9)
    assert float(np.abs(x[0] - c).max()) < 0.01 * float(np.abs(x0.mean(0) - x0[0]).max())


# ---------------------------------------------------------------------------- EA-wild drag
def _eawild_drift(rank, world, group_size, lock, compensate, steps, lr, alpha):
    """EAWild under a constant gradient (every coordinate 1) from a common start: each worker's
    position after a quarter, three quarters and all of ``steps`` local steps (one step-mode
    round; the middle half is the steady state: the start settles the gap, and at the end the
    workers that finish first no longer push)."""
    from pipeline.train.algorithms.eawild import EAWild
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    x = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
    alg = EAWild([x], torch.optim.SGD([x], lr=lr), comm, tau=1, alpha=alpha, group_size=group_size, lock=lock,
                 compensate=compensate, round_steps=steps, timeout_s=30)
    snaps = {}
    for k in range(steps):
        x.grad = torch.ones_like(x)
        alg.step()
        time.sleep(0.006)   # every worker at about the same step rate (rank 0 reaches the centre in memory)
        if k + 1 in (steps // 4, 3 * steps // 4):
            snaps[k + 1] = x.detach().clone()
    assert alg.round_finished
    out = {"q1": _gather(snaps[steps // 4], world), "q3": _gather(snaps[3 * steps // 4], world),
           "x": _gather(x.detach().clone(), world), "c": alg.centre_flat().numpy()}
    alg.close()
    return out


@pytest.mark.parametrize("world,group_size,lock", [(4, 1, False), (4, 1, True), (3, 1, True), (4, 2, True)])
def test_eawild_moves_at_one_over_the_drag_factor_and_compensation_restores_the_gradient_speed(world, group_size,
                                                                                                lock):
    """Under a constant gradient the workers and the centre settle into one velocity: lr / f per
    local step for EA-wild as published (f = drag_factor(alpha, M, G, lock): 1.35 for M = 4 and
    alpha 0.1 lock-free, 1.28 locked), lr with ``compensate`` (each gradient step scaled by f): the
    speed of AR-SGD per sample."""
    from pipeline.train.algorithms.eawild import drag_factor

    steps, lr, alpha = 400, 0.01, 0.1
    f = drag_factor(alpha, world, group_size, lock)
    assert f > 1.1
    v = {}
    for compensate, want in ((False, lr / f), (True, lr)):
        out = run_procs(_eawild_drift, world, group_size, lock, compensate, steps, lr, alpha)
        assert all(err is None for _, err in out.values()), out
        r0 = out[0][0]
        v[compensate] = float(((r0["q1"] - r0["q3"]) / (3 * steps // 4 - steps // 4)).mean())   # descent per step
        assert v[compensate] == pytest.approx(want, rel=0.08), (compensate, v, want, f)
        gap = float(np.abs(r0["x"].mean(0) - r0["c"]).max())     # the centre follows at a bounded distance
        assert gap < 0.2 * lr * steps, gap
    # the timing of a loaded machine biases both runs alike; their ratio is the factor itself
    assert v[True] / v[False] == pytest.approx(f, rel=0.04), (v, f)


def _eawild_killed(rank, world, victim, outdir):
    """EAWild (lock-free, remote pushes on the sending thread) with per-round output; ``victim``
    SIGKILLs itself in its second round."""
    from pipeline.outputs import atomic_output_dir
    from pipeline.train.algorithms.eawild import EAWild
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    x = torch.nn.Parameter(_vector(rank))
    alg = EAWild([x], torch.optim.SGD([x], lr=0.01), comm, alpha=0.2, round_steps=10, timeout_s=5)
    t0 = time.time()
    try:
        with atomic_output_dir(os.path.join(outdir, f"rank{rank}")) as tmp:
            for r in range(6):
                for k in range(10):
                    x.grad = torch.ones_like(x)
                    alg.step()
                    time.sleep(0.005)
                    if rank == victim and r == 1 and k == 4:
                        os.kill(os.getpid(), signal.SIGKILL)
                np.save(os.path.join(tmp, f"round{r}.npy"), x.detach().numpy())
    finally:
        alg.close()
    return time.time() - t0


@pytest.mark.parametrize("victim", [0, 2])
def test_eawild_a_peer_killed_mid_run_fails_the_others_clearly(tmp_path, victim):
    """The centre holder (0) or a remote pusher (2) killed mid-round: the survivors (a push in
    flight on the sending thread included) end with a PeerError naming their rank within the
    timeouts, and write nothing."""
    world = 3
    t0 = time.time()
    out = run_procs(_eawild_killed, world, victim, str(tmp_path), timeout=90, expect=world - 1)
    _survivors_failed_cleanly(out, world, victim, tmp_path, time.time() - t0, 60)
