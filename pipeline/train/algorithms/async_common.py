"""What the asynchronous algorithms (``adpsgd``, ``eawild``, ``async_ps``) share: their round and
liveness parameters, the checks of a config against them, and :class:`AsyncAlgorithm`.

Rounds
------
An asynchronous algorithm is a :class:`~.base.RoundAlgorithm` (``variable_steps``,
``rounds_done``, ``round_finished``, ``nominal_steps_per_round``, ``reset_clock``), so the
round-driven training loop runs it. Inside a round nobody waits for anybody: the
communication goes on in the background (AD-PSGD's thread, the centre holder's threads, a
link's sending thread) or against the holder only. A round ends

* after ``round_seconds`` of wall clock (time mode: every worker stops at the same time and
  a slow worker simply took fewer steps), or
* after ``round_steps`` local steps of this worker (step mode: every worker takes the same
  number of steps, so a run processes exactly the samples of AR-SGD; a fast worker waits at
  the round end for the slowest).

At a round end the algorithm QUIESCES its communication: every exchange in flight finishes,
the serving threads have heard "end of round" from every peer, and nothing touches the model
until this worker's next ``step()``. Round boundaries are therefore safe for collectives on
the world communicator: evaluation, SlowMo's outer step (``tau`` counts rounds,
:class:`.slowmo.RoundSlowMo`), the final average, checkpoints.

Slow is not dead
----------------
Every wait for a peer (a round end, the holder's reply or lock, an averaging in flight) has no
time bound while the peer is alive, and fails with a PeerError as soon as it is not: its
connection closed, or its heartbeat was silent for ``timeout_s`` (``comm/liveness.py``). While
a peer it waits for makes progress, the waiting worker's watchdog is kept quiet.

Devices: the pair channels carry host tensors; so do the algorithms' own collectives (centre
broadcast, group averages, metrics), on the communicator's host view (``comm.host()``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from ...errors import ConfigError
from ..comm import simclock
from ..comm.liveness import wait_until
from .async_stats import AsyncStats, combine
from .averaging import bn_buffers
from .base import RoundAlgorithm

TORCH_LAUNCHERS = "launcher=torch or launcher=local (or launcher=inprocess, simulated)"
LEAVE_WAIT_S = 10.0   # how long a worker that stops serves peers still to leave (close(), also after a failure)
ASYNC_ALGORITHMS = ("adpsgd", "eawild", "async_ps")
ASYNC_LAUNCHERS = ("torch", "local", "inprocess")


class AsyncParams(BaseModel):
    """Round and liveness parameters common to the asynchronous algorithms."""

    model_config = ConfigDict(extra="forbid")
    round_steps: int = Field(8, ge=1, description="local steps per round (time mode: expected steps per round)")
    round_seconds: Optional[float] = Field(None, gt=0, description="wall-clock rounds of this length (time mode)")
    timeout_s: float = Field(60.0, gt=0, description="seconds without a heartbeat after which a peer counts as dead "
                                                     "(a slow but live peer is waited for without a bound)")
    seed: Optional[int] = Field(None, description="seed of random peer choices (default: rank-derived)")

    def time_round_steps(self) -> int:
        """Asynchronous: what happens between steps depends on time (time mode: a round of round_seconds
        is meant to hold round_steps steps; ``algorithms.time_round_steps``)."""
        return self.round_steps


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


def require_point_to_point(name: str, comm) -> None:
    """Refuse a communicator without point-to-point channels (Horovod) in ONE line."""
    if comm.world_size > 1 and not comm.point_to_point:
        raise ConfigError(f"invalid config value algorithm.name={name!r} with the {type(comm).__name__}: "
                          f"asynchronous algorithms need point-to-point messages; use {TORCH_LAUNCHERS}")


def exchanged_tensors(model_params, averager) -> list[torch.Tensor]:
    """Parameters (+ BatchNorm buffers under policy.batchnorm=average); momentum stays local."""
    ts = [p.data for p in model_params]
    if averager is not None and getattr(averager, "batchnorm", "local") == "average" and hasattr(averager, "model"):
        ts += bn_buffers(averager.model)
    return ts


def future_done(fut) -> Callable[[Optional[float]], bool]:
    """``done(timeout)`` of a future (``concurrent.futures.Future`` or its simulated counterpart,
    :func:`~..comm.simclock.future`), for :func:`~..comm.liveness.wait_until`."""
    def done(timeout: Optional[float]) -> bool:
        if not fut.done():
            try:
                fut.exception(timeout)   # waits up to ``timeout``
            except TimeoutError:
                pass
        return fut.done()

    return done


class AsyncAlgorithm(RoundAlgorithm):
    """Round clock, model lock, liveness-aware waits, measurements and shutdown of an
    asynchronous algorithm, on the hook protocol of :class:`~.base.Algorithm`.

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
        require_point_to_point(self.name, comm)
        self.round_steps, self.round_seconds, self.timeout_s = int(round_steps), round_seconds, float(timeout_s)
        self.nominal_steps_per_round = int(round_steps)
        self.rounds_done = 0
        self.round_finished = False
        self.steps_in_round = 0
        self.lock = simclock.lock()  # held while anything writes the model
        self.clock = simclock.clock()  # virtual seconds in a simulated run (comm/simclock.py)
        self.stats = AsyncStats()
        self.channel = None
        # collective at construction (same order on every rank): the host view, then the heartbeats
        self.host = comm.host()
        self.liveness = comm.liveness(self.timeout_s) if comm.world_size > 1 else None
        self.keepalive: Optional[Callable[[], None]] = None
        self._in_round = False
        self._closed = False
        self._last_metrics: dict = {}
        self._round_t0 = self.clock()

    def on_start(self, worker: Any = None) -> None:
        """Waiting for a peer that makes progress beats the worker's watchdog (see module docstring)."""
        self.keepalive = getattr(worker, "beat", None)

    # -- the round protocol
    def reset_clock(self) -> None:
        self._round_t0 = self.clock()

    def _round_due(self) -> bool:
        if self.round_seconds is not None:
            return self.clock() - self._round_t0 >= self.round_seconds
        return self.steps_in_round >= self.round_steps

    # -- the hook protocol
    def before_step(self) -> None:
        if not self._in_round:
            self.begin_comm_round()
            self._in_round = True
        self.round_finished = False

    def apply_step(self) -> None:
        self.local_step()

    def after_step(self) -> None:
        self.stats.add_step()
        if self.liveness is not None:
            self.liveness.note_progress()
        self.steps_in_round += 1
        if self._round_due():
            self.finish_round()

    def finish_round(self) -> None:
        t0 = self.clock()
        self.end_comm_round()
        self.stats.add_idle(self.clock() - t0)
        self._in_round = False
        self.rounds_done += 1
        self.steps_in_round = 0
        self.round_finished = True
        self._round_t0 = self.clock()

    def in_sync(self) -> bool:
        return self.comm.world_size == 1

    # -- waiting for peers
    def wait(self, done: Callable[[float], bool], peers, what: str, idle: bool = True) -> None:
        """Wait for ``done`` while ``peers`` are alive (see module docstring); the time counts as idle
        (``idle=False``: a wait the caller accounts for, the round end's)."""
        t0 = self.clock()
        try:
            wait_until(done, self.liveness, peers, what, self.keepalive)
        finally:
            if idle:
                self.stats.add_idle(self.clock() - t0)

    # -- measurements (collective over the world, at round boundaries)
    def eval_metrics(self) -> dict:
        mine = {**self.stats.snapshot(), **(self.channel.stats() if self.channel is not None else {})}
        self.stats.reset()
        with self.host.stats_paused():
            parts = self.host.allgather_object(mine)
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
        """Tell the peers this worker is gone and stop the threads; never waits long for peers."""
        if not self._closed:
            self._closed = True
            try:
                self.leave(LEAVE_WAIT_S)
            except Exception:  # noqa: BLE001 - close() runs after failures too: the first error is reported
                pass

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rounds_done": self.rounds_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds_done = int(state.get("rounds_done", 0))
