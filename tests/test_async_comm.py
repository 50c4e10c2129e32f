"""The communication cores of the asynchronous algorithms, without gradients, in real processes
joined by torch.distributed (gloo): AD-PSGD's pairwise averaging thread, the centre holder of
EA-wild and the parameter server (lock-free and locked) and its round gate, including early
leavers and a peer killed mid-run."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from async_fixtures import DIM, gather as _gather, run_procs, survivors_failed_cleanly as _survivors_failed_cleanly
from async_fixtures import vector as _vector

pytestmark = pytest.mark.cluster


def _liveness(dead_after_s: float):
    """This process's heartbeats (the channels and waits explain and detect a silent peer with it)."""
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    return TorchDistCommunicator().liveness(dead_after_s)


# ---------------------------------------------------------------------------- AD-PSGD
def _adpsgd(rank, world, slow, rounds, round_s, leave_after):
    from pipeline.train.algorithms.adpsgd import PairAveraging, adpsgd_pairs
    from pipeline.train.comm.p2p import P2PChannel

    x = _vector(rank)
    live = _liveness(20)
    core = PairAveraging(P2PChannel(adpsgd_pairs(world), live), [x], threading.Lock(), seed=3,
                         delay_s=0.01 if rank == slow else 0.0)
    snaps = [_gather(x, world)]
    for r in range(rounds):
        if r == leave_after.get(rank, -1):
            break
        core.begin_round()
        time.sleep(round_s)
        core.end_round()
        if not leave_after:
            snaps.append(_gather(x, world))
    core.leave(60)
    if leave_after:
        snaps.append(_gather(x, world))
    live.stop()
    return {"snaps": snaps, "exchanges": core.stats.exchanges, "staleness": dict(core.stats.staleness)}


def _adpsgd_paced(rank, world, per_step, steps):
    """PairAveraging with its computation thread replaced by ``steps`` notifications 20 ms apart."""
    from pipeline.train.algorithms.adpsgd import PairAveraging, adpsgd_pairs
    from pipeline.train.comm.p2p import P2PChannel

    x = _vector(rank)
    live = _liveness(20)
    core = PairAveraging(P2PChannel(adpsgd_pairs(world), live), [x], threading.Lock(), seed=3,
                         per_step=per_step)
    core.begin_round()
    for _ in range(steps):
        core.notify_step()
        time.sleep(0.02)
    core.end_round()
    core.leave(30)
    live.stop()
    return core.stats.exchanges


def test_adpsgd_step_pace_starts_at_most_one_averaging_per_gradient_step():
    """pace "step": each active starts at most one averaging per notified step (and keeps up with
    20 ms steps); "free" averages back to back, more than once per step, in the same time. (Free
    made about 3-6 averagings per step here; the bound is one per step so that a loaded CI machine,
    which made 70 in 25 steps, still passes, and a "free" that waits for steps still fails.)"""
    world, steps = 4, 25
    paced = run_procs(_adpsgd_paced, world, True, steps)
    free = run_procs(_adpsgd_paced, world, False, steps)
    assert all(err is None for _, err in list(paced.values()) + list(free.values())), (paced, free)
    for r in (0, 2):   # the actives: what they started
        assert steps // 2 <= paced[r][0] <= steps, paced[r][0]
        assert free[r][0] > steps, free[r][0]


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
    core = PairAveraging(P2PChannel(adpsgd_pairs(world), _liveness(5)), [x], threading.Lock(), seed=3)
    t0 = time.time()
    with atomic_output_dir(os.path.join(outdir, f"rank{rank}")) as tmp:
        for r in range(6):
            core.begin_round()
            time.sleep(0.2)
            if rank == victim and r == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            core.end_round()
            np.save(os.path.join(tmp, f"round{r}.npy"), x.numpy())
        core.leave(10)
    return time.time() - t0


def test_adpsgd_a_peer_killed_mid_run_fails_the_others_clearly(tmp_path):
    world, victim = 3, 1
    t0 = time.time()
    out = run_procs(_adpsgd_killed, world, victim, str(tmp_path), timeout=60, expect=world - 1)
    _survivors_failed_cleanly(out, world, victim, tmp_path, time.time() - t0, 45)


# ---------------------------------------------------------------------------- EA-wild holder
def _eawild(rank, world, locked, seconds, alpha, slow):
    from pipeline.train.algorithms.async_stats import AsyncStats
    from pipeline.train.algorithms.centre import CentreHolder, CentreLink, centre_pairs
    from pipeline.train.algorithms.eawild import elastic_rule
    from pipeline.train.comm.liveness import wait_until
    from pipeline.train.comm.p2p import P2PChannel

    liveness = _liveness(20)
    ch = P2PChannel(centre_pairs(world), liveness)
    x = _vector(rank)
    c0 = _vector(0)  # every worker starts from rank 0's vector; the centre too
    x.copy_(c0) if rank == 0 else None
    holder = CentreHolder(ch, c0, elastic_rule, DIM + 1, locked) if rank == 0 else None
    link = CentreLink(ch, holder, DIM, torch.float64, AsyncStats(),
                      lambda done, peers, what, idle=True: wait_until(done, liveness, peers, what))
    link.begin_round()
    pulled = c0.clone()
    x0 = x.clone()

    def update(c):  # EA-wild's exchange without gradients: push the pre-move x, then move towards the pull
        pre = x.clone()
        x.add_(pre - c, alpha=-alpha)
        return torch.cat([pre, torch.tensor([alpha], dtype=x.dtype)])

    pushes, t_end = 0, time.time() + seconds
    while time.time() < t_end:  # every worker pushes until the same wall-clock end; one is 5x slower
        if locked:
            link.push_locked(update(link.acquire()))
        else:
            pulled = link.push(update(pulled))
        pushes += 1
        time.sleep(0.01 if rank == slow else 0.002)
    link.end_round(liveness)
    xs = _gather(x, world)
    link.leave(30)
    liveness.stop()
    return {"pushes": pushes, "x0": _gather(x0, world), "x": xs, "c": None if holder is None else holder.c.numpy(),
            "order": None if holder is None else list(holder.order)}


def _sequential_easgd(x0: np.ndarray, c0: np.ndarray, order: list[int], alpha: float):
    """Zhang et al. 2015 / Wongpanich et al. 2020 eq. (2)-(3) without gradients, one worker at a
    time in ``order``: both updates use the values before the update."""
    x, c = x0.copy(), c0.copy()
    for j in order:
        x[j], c = x[j] - alpha * (x[j] - c), c + alpha * (x[j] - c)
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
        xr, cr = _sequential_easgd(r0["x0"], r0["x0"][0], order, alpha)
        np.testing.assert_allclose(x, xr, rtol=0, atol=1e-12)
        np.testing.assert_allclose(c, cr, rtol=0, atol=1e-12)




# ---------------------------------------------------------------------------- the parameter server's round gate
def _ps_gate(rank, world, lr):
    """AsyncPS on one vector: round 0 (one step each), an identical move of every worker's synced
    model (what SlowMo's outer step does), round 1 in which rank 1 pushes at once. Rank 0 holds
    its round gate open (the serving thread's ``opened`` hook) until that waiting push has been
    applied, so the push lands in the window right after the gate opens."""
    from pipeline.train.algorithms.async_ps import AsyncPS
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    x = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
    alg = AsyncPS([x], torch.optim.SGD([x], lr=lr), comm, round_steps=1, timeout_s=30)
    x.grad = torch.full_like(x, float(rank + 1))
    alg.step()                                   # round 0 ends: every worker holds the server's model
    synced = x.detach().clone()
    with torch.no_grad():
        x.add_(1.0)
    if rank == 0:
        holder, before = alg.holder, alg.holder.version

        def opened(r):
            t_end = time.time() + 10
            while holder.version == before and time.time() < t_end:
                time.sleep(0.01)

        holder.server.opened = opened
    x.grad = torch.full_like(x, float(rank + 1))
    alg.step()                                   # round 1 ends: the server's model again
    out = {"synced": synced.numpy(), "final": x.detach().numpy().copy()}
    alg.close()
    return out


def test_parameter_server_applies_a_push_that_waits_at_the_round_gate_after_the_reset():
    """The holder resets its model to the workers' (moved) model BEFORE it opens the next round:
    a push waiting at the gate is applied to the reset model, not overwritten by the reset."""
    world, lr = 2, 0.1
    res = [r for r, _ in run_procs(_ps_gate, world, lr).values()]
    assert all(r is not None for r in res), res
    synced = res[0]["synced"]
    # round 0: both pushes (gradients 1 and 2, each at lr / M); round 1: the same after the +1 move
    np.testing.assert_allclose(synced, -lr / world * (1 + 2), rtol=0, atol=1e-12)
    for r in res:
        np.testing.assert_allclose(r["final"], synced + 1 - lr / world * (1 + 2), rtol=0, atol=1e-12)
