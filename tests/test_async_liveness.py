"""Slow is not dead: the asynchronous algorithms wait for a live peer however slow it is, and
still fail fast, naming the peer, when a peer is gone (killed: its connections close; frozen:
its heartbeats stop). ``timeout_s`` bounds the silence of a peer's heartbeats, not its pace.

Real processes joined by torch.distributed (gloo), the algorithms built through the registry.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from async_fixtures import gather, results, run_procs, vector

pytestmark = pytest.mark.cluster


def _build(name: str, params: dict, lr: float = 0.01):
    from pipeline.train.algorithms import BuildContext, build_algorithm
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    model = torch.nn.Module()
    model.x = torch.nn.Parameter(vector(0).clone())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    algo = build_algorithm(name, params, BuildContext(model, opt, comm, None, seed=1))
    algo.on_start()
    return comm, model.x, algo


def _with_a_pause(rank, world, name, params, slow_rank, pause_s, rounds, h):
    """``rounds`` step-mode rounds of ``h`` steps; ``slow_rank`` pauses ``pause_s`` once, mid-round."""
    comm, x, algo = _build(name, params)
    target = vector(10 + rank)
    paused = 0.0
    for k in range(rounds * h):
        x.grad = x.detach() - target
        algo.step()
        time.sleep(0.003)
        if rank == slow_rank and k == h + h // 2:
            t0 = time.perf_counter()
            time.sleep(pause_s)
            paused = time.perf_counter() - t0
    algo.on_finish()
    out = {"steps": algo.step_count, "rounds": algo.rounds_done, "paused": paused,
           "x": gather(x.detach().clone(), world)}
    algo.close()
    return out


CASES = {  # (algorithm, params, the slow rank): who waits for it, and where
    "eawild_slow_client": ("eawild", {"alpha": 0.2}, 2),          # the holder's round end and serving thread
    "eawild_locked_slow_holder": ("eawild", {"alpha": 0.2, "lock": True}, 0),   # the clients' lock requests
    "async_ps_slow_holder": ("async_ps", {}, 0),                   # the clients' pushes at the round gate
    "adpsgd_slow_passive": ("adpsgd", {}, 1),                      # the actives' averagings at its round gate
    "adpsgd_slow_active": ("adpsgd", {}, 0),                       # the passive's round end
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_worker_three_times_slower_than_the_timeout_allows_finishes(case):
    """timeout_s = 1 s and one worker pauses 3.5 s mid-round: every worker finishes every round
    (the others wait for it, without a bound, while its heartbeats say it is alive)."""
    name, params, slow = CASES[case]
    world, timeout_s, pause_s, rounds, h = 3, 1.0, 3.5, 3, 6
    res = results(run_procs(_with_a_pause, world, name, {**params, "round_steps": h, "timeout_s": timeout_s},
                            slow, pause_s, rounds, h, timeout=180))
    assert res[slow]["paused"] >= 3 * timeout_s
    assert [r["steps"] for r in res] == [rounds * h] * world
    assert [r["rounds"] for r in res] == [rounds] * world
    assert np.isfinite(res[0]["x"]).all()


def _frozen(rank, world, victim, stopfile):
    """EA-wild with timeout_s = 1 s; ``victim`` freezes (SIGSTOP: its process and heartbeats stop,
    its connections stay open) in its second round. A survivor returns its error and when it came."""
    comm, x, algo = _build("eawild", {"alpha": 0.2, "round_steps": 10, "timeout_s": 1.0})
    try:
        for k in range(60):
            x.grad = torch.ones_like(x)
            algo.step()
            time.sleep(0.005)
            if rank == victim and k == 14:
                with open(stopfile, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
        algo.on_finish()
        gather(x.detach().clone(), world)
        return {"error": None, "t": time.time()}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "t": time.time()}
    finally:
        algo.close()


@pytest.mark.parametrize("victim,waiting", [(0, [1, 2]), (2, [0])])
def test_a_frozen_peer_is_detected_within_a_few_heartbeat_timeouts(tmp_path, victim, waiting):
    """The holder (0) or a client (2) frozen: the workers that wait for it (the clients for their
    replies; the holder for the round's END) fail with a PeerError naming their own rank and the
    frozen one, within seconds of the freeze (timeout_s = 1 s); every survivor fails."""
    world, stopfile = 3, tmp_path / "stopped"
    out = run_procs(_frozen, world, victim, str(stopfile), timeout=120, expect=world - 1)
    assert set(out) == set(range(world)) - {victim}
    t_stop = float(stopfile.read_text())
    for rank, (res, err) in out.items():
        assert err is None and res["error"] is not None, (rank, res, err)
        if rank in waiting:
            msg = res["error"]
            assert msg.startswith("PeerError") and f"rank {rank}" in msg and f"rank {victim}" in msg, msg
            assert res["t"] - t_stop < 15, (res["t"] - t_stop, msg)
