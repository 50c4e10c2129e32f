"""What the asynchronous algorithms (``adpsgd``, ``eawild``, ``async_ps``) share.

Rounds
------
An asynchronous algorithm follows the round protocol of :mod:`.rounds` (``variable_steps``,
``rounds_done``, ``round_finished``, ``nominal_steps_per_round``, ``reset_clock``), so the
round-driven training loop runs it. Inside a round nobody waits for anybody: the
communication goes on in the background (AD-PSGD's thread, the centre holder's thread) or
against the holder only. A round ends

* after ``round_seconds`` of wall clock (time mode: every worker stops at the same time and
  a slow worker simply took fewer steps), or
* after ``round_steps`` local steps of this worker (step mode: every worker takes the same
  number of steps, so a run processes exactly the samples of AR-SGD; a fast worker waits at
  the round end for the slowest).

At a round end the algorithm QUIESCES its communication: every exchange in flight finishes,
the serving threads have heard "end of round" from every peer, and nothing touches the model
until this worker's next ``step()``. Round boundaries are therefore safe for collectives on
the world communicator: evaluation, SlowMo's outer step (``tau`` counts rounds,
:class:`.rounds.RoundSlowMo`), the final average, checkpoints.

Measurements (:meth:`AsyncAlgorithm.eval_metrics`, a collective): staleness histogram,
per-worker fraction of time idle (waiting at round ends, for the holder's reply or its lock),
exchanges per second and averaging rate (exchanges per gradient step).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from ...errors import ConfigError
from .base import RoundAlgorithm
from .averaging import bn_buffers

TORCH_LAUNCHERS = "launcher=torch or launcher=local"


class AsyncParams(BaseModel):
    """Round and transport parameters common to the asynchronous algorithms."""

    model_config = ConfigDict(extra="forbid")
    round_steps: int = Field(8, ge=1, description="local steps per round (time mode: expected steps per round)")
    round_seconds: Optional[float] = Field(None, gt=0, description="wall-clock rounds of this length (time mode)")
    timeout_s: float = Field(60.0, gt=0, description="seconds a peer may stay silent before the run fails")
    seed: Optional[int] = Field(None, description="seed of random peer choices (default: rank-derived)")


ASYNC_ALGORITHMS = ("adpsgd", "eawild", "async_ps")
ASYNC_LAUNCHERS = ("torch", "local")


def base_algorithm(name: str, params: Optional[dict]) -> tuple[str, dict]:
    """The algorithm under any SlowMo wrappers and its parameters."""
    base, params = name, params or {}
    while base == "slowmo":
        base, params = params.get("base", "local_sgd"), params.get("base_params", {}) or {}
    return base, params


def check_launcher(name: str, params: dict, launcher: str) -> None:
    """Refuse an asynchronous algorithm (also as SlowMo's base) under a launcher without
    torch.distributed point to point, in one line naming the algorithm and the launchers."""
    base, params = base_algorithm(name, params)
    if base in ASYNC_ALGORITHMS and launcher not in ASYNC_LAUNCHERS:
        raise ConfigError(f"invalid config value launcher={launcher!r} for algorithm {base!r}: the asynchronous "
                          f"algorithms need torch.distributed point-to-point messages; use {TORCH_LAUNCHERS}")


def check_group_size(group_size, world: int) -> None:
    """EA-wild's groups must split the workers evenly: one line naming the value otherwise."""
    try:
        g = int(group_size)
    except (TypeError, ValueError):
        g = 0
    if g < 1 or world % g:
        raise ConfigError(f"invalid config value algorithm.params.group_size={group_size!r}: it must be a positive "
                          f"divisor of the {world} workers")


def check_world(name: str, params: Optional[dict], world: int) -> None:
    """Checks of an asynchronous algorithm's parameters against the number of workers (at planning)."""
    base, params = base_algorithm(name, params)
    if base == "eawild" and "group_size" in params:
        check_group_size(params["group_size"], world)


def require_torch_distributed(name: str, comm) -> None:
    """Refuse a communicator without torch.distributed point to point (Horovod) in ONE line."""
    if comm.world_size == 1:
        return
    import torch.distributed as dist

    if type(comm).__name__ != "TorchDistCommunicator" or not dist.is_initialized():
        raise ConfigError(f"invalid config value algorithm.name={name!r} with the {type(comm).__name__}: "
                          f"asynchronous algorithms need point-to-point messages; use {TORCH_LAUNCHERS}")


def exchanged_tensors(model_params, averager) -> list[torch.Tensor]:
    """Parameters (+ BatchNorm buffers under policy.batchnorm=average); momentum stays local."""
    ts = [p.data for p in model_params]
    if averager is not None and getattr(averager, "batchnorm", "local") == "average" and hasattr(averager, "model"):
        ts += bn_buffers(averager.model)
    return ts


def flat_copy(tensors) -> torch.Tensor:
    """One contiguous CPU copy of ``tensors`` in the first tensor's dtype (the message payload)."""
    dt = tensors[0].dtype
    return torch.cat([t.detach().reshape(-1).to("cpu", dt) for t in tensors])


def add_flat_(tensors, delta: torch.Tensor, alpha: float = 1.0) -> None:
    """tensors += alpha * delta (delta flat, CPU) in place, through ``.data`` (not seen by autograd)."""
    o = 0
    for t in tensors:
        n = t.numel()
        t.data.add_(delta[o:o + n].view_as(t).to(t.device, t.dtype), alpha=alpha)
        o += n


def copy_flat_(tensors, flat: torch.Tensor) -> None:
    o = 0
    for t in tensors:
        n = t.numel()
        t.data.copy_(flat[o:o + n].view_as(t).to(t.device, t.dtype))
        o += n


class AsyncStats:
    """Counters of one worker since the last evaluation (thread safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total_steps = 0  # gradient steps of the whole run (not reset)
        self.reset()

    def reset(self) -> None:
        with getattr(self, "_lock", threading.Lock()):
            self.staleness: Counter = Counter()
            self.exchanges = 0
            self.idle_s = 0.0
            self.grad_steps = 0
            self.t0 = time.perf_counter()

    def add_staleness(self, s: int) -> None:
        with self._lock:
            self.staleness[int(s)] += 1

    def add_exchange(self) -> None:
        with self._lock:
            self.exchanges += 1

    def add_idle(self, s: float) -> None:
        with self._lock:
            self.idle_s += s

    def snapshot(self) -> dict:
        with self._lock:
            wall = max(time.perf_counter() - self.t0, 1e-9)
            return {"staleness": dict(self.staleness), "exchanges": self.exchanges, "idle_s": self.idle_s,
                    "grad_steps": self.grad_steps, "total_steps": self.total_steps, "wall_s": wall}


def combine(parts: list[dict]) -> dict:
    """The record fields of :meth:`AsyncAlgorithm.eval_metrics` from every worker's snapshot."""
    hist: Counter = Counter()
    for p in parts:
        hist.update({int(k): v for k, v in p["staleness"].items()})
    top = max(hist) if hist else -1
    wall = max(p["wall_s"] for p in parts)
    n = sum(hist.values())
    return {"staleness_hist": [hist.get(i, 0) for i in range(top + 1)],
            "staleness_mean": (sum(k * v for k, v in hist.items()) / n) if n else None,
            "idle_fraction": [round(p["idle_s"] / p["wall_s"], 4) for p in parts],
            "exchanges_per_s": round(sum(p["exchanges"] for p in parts) / wall, 3),
            "averaging_rate": [round(p["exchanges"] / p["grad_steps"], 4) if p["grad_steps"] else None
                               for p in parts],
            "worker_steps_per_s": [round(p["grad_steps"] / p["wall_s"], 3) for p in parts],
            "global_steps": sum(p.get("total_steps", 0) for p in parts)}


class AsyncAlgorithm(RoundAlgorithm):
    """Round clock, model lock, measurements and shutdown of an asynchronous algorithm.

    Subclasses implement ``local_step()`` (the update of one gradient step, called with the
    gradients in place), ``begin_comm_round()`` / ``end_comm_round()`` (start / quiesce the
    background communication of a round) and ``leave()`` (stop for good, without blocking
    peers that go on).
    """

    variable_steps = True
    owns_communication = True

    def __init__(self, params, optimizer, comm, *, round_steps: int = 8, round_seconds: Optional[float] = None,
                 timeout_s: float = 60.0) -> None:
        super().__init__(params, optimizer, comm)
        require_torch_distributed(self.name, comm)
        self.round_steps, self.round_seconds, self.timeout_s = int(round_steps), round_seconds, float(timeout_s)
        self.nominal_steps_per_round = int(round_steps)
        self.rounds_done = 0
        self.round_finished = False
        self.steps_in_round = 0
        self.lock = threading.Lock()  # held while anything writes the model
        self.stats = AsyncStats()
        self.channel = None
        self._in_round = False
        self._closed = False
        self._last_metrics: dict = {}
        self._round_t0 = time.perf_counter()

    # -- the round protocol
    def reset_clock(self) -> None:
        self._round_t0 = time.perf_counter()

    def _round_due(self) -> bool:
        if self.round_seconds is not None:
            return time.perf_counter() - self._round_t0 >= self.round_seconds
        return self.steps_in_round >= self.round_steps

    def step(self) -> None:
        if not self._in_round:
            self.begin_comm_round()
            self._in_round = True
        self.round_finished = False
        self.local_step()
        self.stats.grad_steps += 1
        self.stats.total_steps += 1
        self.step_count += 1
        self.steps_in_round += 1
        if self._round_due():
            self.finish_round()

    def finish_round(self) -> None:
        t0 = time.perf_counter()
        self.end_comm_round()
        self.stats.add_idle(time.perf_counter() - t0)
        self._in_round = False
        self.rounds_done += 1
        self.steps_in_round = 0
        self.round_finished = True
        self._round_t0 = time.perf_counter()

    def in_sync(self) -> bool:
        return self.comm.world_size == 1

    # -- measurements (collective over the world communicator, at round boundaries)
    def eval_metrics(self) -> dict:
        mine = {**self.stats.snapshot(), **(self.channel.stats() if self.channel is not None else {})}
        self.stats.reset()
        with self.comm.stats_paused():
            parts = self.comm.allgather_object(mine)
        if sum(p["grad_steps"] for p in parts) == 0 and self._last_metrics:
            return self._last_metrics  # nothing happened since (the test record right after the last one)
        self._last_metrics = combine(parts)
        return self._last_metrics

    def summary_stats(self) -> dict:
        return self.channel.stats() if self.channel is not None else {}

    # -- subclass hooks
    def local_step(self) -> None:
        with self.lock:
            self.optimizer.step()

    def begin_comm_round(self) -> None:
        pass

    def end_comm_round(self) -> None:
        pass

    def leave(self, timeout_s: Optional[float]) -> None:
        pass

    def on_finish(self, worker: Any = None) -> None:
        """Quiesce: the run ends at a round boundary; a run stopped mid-round ends the round here."""
        if self._in_round:
            self.finish_round()

    def close(self) -> None:
        """Tell the peers this worker is gone and stop the thread; never waits long for peers."""
        if not self._closed:
            self._closed = True
            try:
                self.leave(min(self.timeout_s, 10.0))
            except Exception:  # noqa: BLE001 - close() runs after failures too: the first error is reported
                pass

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rounds_done": self.rounds_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds_done = int(state.get("rounds_done", 0))


class RoundServer:
    """The serving side of an asynchronous algorithm: one thread per client, with round gating.

    Each thread blocks on a receive from its client (its own pair group, see
    :mod:`~..comm.p2p`) and calls ``handle(src, kind)`` for every request; END closes the
    client's round r, after which the thread waits until the main thread begins round r + 1
    (so nothing is served while the main thread is in a collective); LEAVE retires the client.
    ``leave()`` switches gating off: the threads serve until every client has left.
    """

    def __init__(self, channel, clients, handle, name: str) -> None:
        from ..comm.p2p import END, LEAVE

        self._END, self._LEAVE = END, LEAVE
        self.ch, self.clients, self.handle = channel, list(clients), handle
        self.cv = threading.Condition()
        self.begun = -1
        self.ended = {c: -1 for c in self.clients}
        self.left: set[int] = set()
        self.leaving = False
        self.error: Optional[BaseException] = None
        self.threads = [threading.Thread(target=self._serve, args=(c,), daemon=True, name=f"{name}-{c}")
                        for c in self.clients]
        for t in self.threads:
            t.start()

    def _serve(self, src: int) -> None:
        r = 0
        try:
            while True:
                with self.cv:
                    self.cv.wait_for(lambda: self.begun >= r or self.leaving or self.error is not None)
                    if self.error is not None:
                        return
                while True:
                    kind = self.ch.recv_header(src)[0]
                    if kind == self._END:
                        with self.cv:
                            self.ended[src] = r
                            self.cv.notify_all()
                        r += 1
                        break
                    if kind == self._LEAVE:
                        with self.cv:
                            self.left.add(src)
                            self.cv.notify_all()
                        return
                    self.handle(src, kind)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            with self.cv:
                self.error = self.error or e
                self.cv.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def begin_round(self, r: int) -> None:
        self.check()
        with self.cv:
            self.begun = r
            self.cv.notify_all()

    def end_round(self, r: int, timeout_s: float) -> None:
        def over():
            return self.error is not None or all(self.ended[c] >= r or c in self.left for c in self.clients)

        with self.cv:
            ok = self.cv.wait_for(over, timeout_s)
            missing = [c for c in self.clients if self.ended[c] < r and c not in self.left]
        self.check()
        if not ok:
            from ..comm.p2p import PeerError

            raise PeerError(f"rank {self.ch.rank}: round {r} did not end within {timeout_s:.0f} s: no END from "
                            f"ranks {missing} (a peer stopped without leaving)")

    def leave(self, timeout_s: Optional[float]) -> None:
        with self.cv:
            self.leaving = True
            self.cv.notify_all()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.check()
        if any(t.is_alive() for t in self.threads):
            from ..comm.p2p import PeerError

            raise PeerError(f"rank {self.ch.rank}: clients {sorted(set(self.clients) - self.left)} did not leave "
                            f"within {timeout_s:.0f} s")
