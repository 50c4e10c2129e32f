"""Helpers of the asynchronous-algorithm tests: real worker processes joined by torch.distributed
(gloo) on loopback, seeded vectors, and the checks of a run whose peer was killed.

The worker functions run in spawned processes and return plain data; the tests assert in the
parent against values computed there independently.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue as queue_mod
import time

import numpy as np
import pytest
import torch

DIM = 257


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), PIPELINE_RUN_SECRET=f"test run {port:05d} " * 4)  # as a launcher hands out
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _call(fn, rank, world, port, args) -> tuple:
    try:
        _init(rank, world, port)
        return fn(rank, world, *args), None
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return None, f"{type(e).__name__}: {e}"


def _report(fn, rank, world, port, q, args) -> None:
    q.put((rank, *_call(fn, rank, world, port, args), False))


def _serve(rank, world, inbox, q):
    """A pooled worker: runs one call after another, each in a process group of its own (a new
    port), which it destroys before it reports. A call that leaves a thread of its own running (a
    heartbeat nobody stopped: it would talk to a store that is gone) marks the process unfit for
    the next call, and the pool is discarded."""
    import threading

    import torch.distributed as dist

    before = {t.ident for t in threading.enumerate()}
    while (job := inbox.get()) is not None:
        fn, port, args = job
        res, err = _call(fn, rank, world, port, args)
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + 2
        new = [t for t in threading.enumerate() if t.ident not in before and t.name != "QueueFeederThread"]
        for t in new:                       # (the feeder thread is the result queue's own, started by a put)
            t.join(max(0.0, deadline - time.monotonic()))
        left = any(t.is_alive() for t in new)
        q.put((rank, res, err, left))


class _Pool:
    """``world`` spawned processes that stay up between calls: the interpreter, torch and the test
    module are imported once per pool instead of once per call (a spawn costs seconds on 2 cores).
    A call with an error, a hang, a dead process or a thread left running discards the pool; the next
    call spawns a new one."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_serve, args=(r, world, self.inboxes[r], self.q), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def healthy(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        _stop(self.procs)


_POOLS: dict[int, _Pool] = {}


def _stop(procs, grace: float = 5) -> None:
    for p in procs:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join(5)


def _collect(q, world: int, expect: int | None, timeout: float) -> tuple[dict, bool]:
    """{rank: (result, error)} of the ranks that reported, and whether any left a thread running."""
    out, left, deadline = {}, False, time.time() + timeout
    try:
        while len(out) < (world if expect is None else expect):
            rank, res, err, threads = q.get(timeout=max(0.1, deadline - time.time()))
            out[rank], left = (res, err), left or threads
    except queue_mod.Empty:
        pytest.fail(f"processes hung: only ranks {sorted(out)} reported within {timeout} s")
    return out, left


def run_procs(fn, world: int, *args, timeout: float = 90.0, expect: int | None = None) -> dict:
    """Run fn(rank, world, *args) in ``world`` spawned processes; {rank: (result, error)} of those that reported.

    With ``expect`` (a run in which some rank is killed or never reports) the processes are spawned
    for this call alone; otherwise the call runs on a pool of processes kept for the next call of
    the same world size, unless a rank failed."""
    from pipeline.train.comm.ports import free_port

    port = free_port()
    if expect is not None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_report, args=(fn, r, world, port, q, args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        out: dict = {}
        try:
            out = _collect(q, world, expect, timeout)[0]
            return out
        finally:   # a rank that never reported (killed, frozen, hung) gets no grace: its end is not under test
            _stop([p for r, p in enumerate(procs) if r not in out], grace=0)
            _stop([p for r, p in enumerate(procs) if r in out])
    pool = _POOLS.pop(world, None)
    if pool is None or not pool.healthy():
        if pool is not None:
            pool.close()
        pool = _Pool(world)
    ok = False
    try:
        for box in pool.inboxes:
            box.put((fn, port, args))
        out, left = _collect(pool.q, world, None, timeout)
        ok = all(err is None for _, err in out.values()) and not left and pool.healthy()
        return out
    finally:
        if ok:
            _POOLS[world] = pool
        else:
            for p in pool.procs:
                p.kill()
            _stop(pool.procs, grace=0)


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def results(out: dict) -> list:
    """The results of every rank, in rank order; fails with every rank's error otherwise."""
    errors = {r: err for r, (_, err) in out.items() if err is not None}
    assert not errors, errors
    return [out[r][0] for r in sorted(out)]


def vector(rank: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(rank).normal(size=DIM) * (rank + 1) + 3 * rank)


def gather(x: torch.Tensor, world: int) -> np.ndarray:
    import torch.distributed as dist

    xs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(xs, x)
    return torch.stack(xs).numpy()


def survivors_failed_cleanly(out: dict, world: int, victim: int, outdir, seconds: float, limit: float) -> None:
    """Every rank but the victim reported a PeerError naming its rank, within ``limit`` seconds,
    and wrote nothing (the killed process could not remove its own temporary directory)."""
    assert set(out) == set(range(world)) - {victim}
    for rank, (res, err) in out.items():
        assert res is None and err is not None, (rank, res)
        assert "PeerError" in err and f"rank {rank}" in err, err
    assert seconds < limit, seconds
    left = [p.name for p in outdir.iterdir() if not p.name.startswith(f".rank{victim}.")]
    assert left == [], left
