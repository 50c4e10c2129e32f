"""AD-PSGD (Lian et al. 2018): asynchronous decentralized SGD, wait-free for the computation.

In every worker two threads share the model. The **computation thread** (the training loop)
computes a gradient on the model as it is and applies it with the base optimizer to the
model as it is then (the other thread may have averaged it meanwhile). The **communication
thread** repeatedly averages the model with one peer::

    x_i, x_j  <-  (x_i + x_j) / 2            atomically for the pair

Deadlock avoidance -- the active/passive bipartition of the reference implementation: even
ranks are ACTIVE, odd ranks PASSIVE (M = 2: 0 active, 1 passive; M = 3: 0, 2 active, 1
passive). Only an active worker starts an averaging, with a passive peer chosen uniformly at
random; a passive worker serves one request at a time (one serving thread per active, each on
its own pair channel, taking turns on a lock). Every worker is in at most one
averaging at a time (its communication thread does one thing at a time), an active waits only
for passives and a passive only for the active it is serving, so there is no cycle of waits.

One averaging, active i with passive j (one flat vector each way, on :class:`~..comm.p2p.P2PChannel`)::

    i: under its model lock, s_i = copy(x_i);  send REQ + s_i to j
    j: receive s_i; under its lock: s_j = copy(x_j); x_j += (s_i - s_j) / 2;  send s_j to i
    i: receive s_j; under its lock: x_i += (s_j - s_i) / 2

The two increments are exact negatives, so the pair's sum (and the global mean) is preserved
even when a gradient step lands on x_i during the exchange (that step is kept, not
overwritten). **Staleness** of an averaging: the gradient steps applied to x_i between the
copy s_i (the pull) and the update. Passive updates are immediate (staleness 0).

Rounds and leaving: see :mod:`.async_common`. At a round end an active finishes its exchange
and sends END to every passive; a passive serves until it heard END (or LEAVE) from every
active. Both waits have no time bound while the peer is alive (its heartbeat goes on). A worker that stops for good (:meth:`PairAveraging.leave`): an active sends LEAVE and
stops; a passive keeps answering requests from its thread, without round gating, until every
active has left (its own computation has stopped, so nobody waits for it).

Pace (``pace``): with ``"step"`` (the default, the rhythm of the reference implementation: one
averaging per iteration) an active starts at most one averaging per gradient step of its own
computation thread; with ``"free"`` it starts the next one as soon as the last is done. On a host
whose cores the workers share, back-to-back averagings take CPU from the gradient steps.

"Thread" above: an active worker has one communication thread; a passive one has one serving
thread per active (see :class:`~..comm.round_server.RoundServer`); either way every worker is in
at most one averaging at a time.
"""
from __future__ import annotations

from typing import Callable, Literal, Optional

import numpy as np
import torch
from pydantic import Field

from ..comm import simclock
from ..comm.fusion import flatten, unflatten_
from ..comm.liveness import wait_until
from ..comm.p2p import END, LEAVE, REQ, P2PChannel, PeerError, open_channel
from ..comm.round_server import RoundServer
from . import BuildContext, Spec
from .async_common import AsyncAlgorithm, AsyncParams, exchanged_tensors
from .async_stats import AsyncStats


def adpsgd_pairs(world: int) -> list[tuple[int, int]]:
    """Every (active, passive) pair of the bipartition: the channels AD-PSGD needs."""
    return [(a, p) for a in range(0, world, 2) for p in range(1, world, 2)]


class PairAveraging:
    """The communication of AD-PSGD over ``tensors`` (guarded by ``lock``).

    Active ranks run one thread that averages with random passives; passive ranks serve each
    active from its own thread (:class:`~..comm.round_server.RoundServer`), one averaging at a
    time (``serve_lock``). ``liveness`` and ``keepalive``: see :mod:`.async_common`."""

    def __init__(self, channel: P2PChannel, tensors: list[torch.Tensor], lock,
                 stats: Optional[AsyncStats] = None, *, seed: int = 0, delay_s: float = 0.0,
                 grad_steps: Callable[[], int] = lambda: 0, per_step: bool = False, keepalive=None) -> None:
        self.ch, self.tensors, self.lock = channel, tensors, lock
        self.keepalive = keepalive
        self.per_step = bool(per_step)  # at most one averaging (started by an active) per notify_step()
        self._stepped = simclock.event()
        self.stats = stats or AsyncStats()
        self.rank, self.world = channel.rank, channel.world_size
        self.actives = list(range(0, self.world, 2))
        self.passives = list(range(1, self.world, 2))
        self.active = self.rank % 2 == 0
        self.rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, self.rank])
        self.delay_s = float(delay_s)
        self.grad_steps = grad_steps
        self.round = 0
        self.error: Optional[BaseException] = None
        self._go, self._stop, self._done = simclock.event(), simclock.event(), simclock.event()
        self._leaving = False
        self._state = "idle"  # what the active thread does now (for error messages)
        self._peer: Optional[int] = None  # the passive the active thread talks to now
        self._numel = sum(t.numel() for t in tensors)
        self._dtype = tensors[0].dtype
        self.serve_lock = simclock.lock()
        self.server: Optional[RoundServer] = None
        self.thread = None
        if self.world > 1 and self.active:
            self.thread = simclock.thread(self._main, name=f"adpsgd-active-{self.rank}")
            self.thread.start()
        elif self.world > 1:
            self.server = RoundServer(channel, self.actives, self._handle, f"adpsgd-passive-{self.rank}")

    # ------------------------------------------------------------------ main-thread API
    def notify_step(self) -> None:
        """The computation thread applied a gradient step (paces the averagings with ``per_step``)."""
        self._stepped.set()

    def check(self) -> None:
        if self.error is not None:
            raise PeerError(str(self.error)) from self.error
        if self.server is not None and self.server.error is not None:
            e = self.server.error
            raise PeerError(str(e)) from e

    def begin_round(self) -> None:
        self.check()
        if self.server is not None:
            self.server.begin_round(self.round)
            return
        self._done.clear()
        self._stop.clear()
        self._go.set()

    def end_round(self) -> None:
        """Quiesce the round: no time bound while the peers waited for are alive."""
        if self.server is not None:
            self.server.end_round(self.round, self.ch.liveness, self.keepalive)
        elif self.thread is not None:
            self._stop.set()
            wait_until(lambda t: self._done.wait(t) or self.error is not None, self.ch.liveness,
                       lambda: [] if self._peer is None else [self._peer],
                       f"round {self.round} of AD-PSGD ({self._state})", self.keepalive)
        self.check()
        self.round += 1

    def leave(self, timeout_s: Optional[float] = None) -> None:
        """Stop for good; a passive returns once every active has left (see module docstring)."""
        if self.server is not None:
            self.server.leave(timeout_s)
        elif self.thread is not None:
            self._leaving = True
            self._stop.set()
            self._go.set()
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                raise PeerError(f"rank {self.rank}: AD-PSGD could not leave within {timeout_s:.0f} s ({self._state})")
        self.check()

    # ------------------------------------------------------------------ active thread
    def _main(self) -> None:
        try:
            self._run_active()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
        finally:
            self._done.set()

    def _run_active(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            while not self._stop.is_set():
                if self.per_step:
                    if not self._stepped.wait(0.05):   # no gradient step yet: look at _stop again
                        continue
                    self._stepped.clear()
                j = int(self.rng.choice(self.passives))
                self._state, self._peer = f"active averaging with rank {j}", j
                self._exchange(j)
                self._peer = None
                if self.delay_s:
                    simclock.sleep(self.delay_s)
            kind = LEAVE if self._leaving else END
            for j in self.passives:
                self._state, self._peer = f"active sending {'LEAVE' if kind == LEAVE else 'END'} to rank {j}", j
                self.ch.send_header(j, kind, self.round)
            self._state, self._peer = "idle", None
            self._done.set()
            if kind == LEAVE:
                return

    def _exchange(self, j: int) -> None:
        with self.lock:
            mine = flatten(self.tensors, device="cpu")
            g0 = self.grad_steps()
        self.ch.send_header(j, REQ, self.round)
        self.ch.send(mine, j)
        theirs = torch.empty(self._numel, dtype=self._dtype)
        self.ch.recv(theirs, j)
        with self.lock:
            unflatten_(theirs - mine, self.tensors, add=0.5)
            stale = self.grad_steps() - g0
        self.stats.add_exchange()
        self.stats.add_staleness(stale)

    # ------------------------------------------------------------------ passive serving threads
    def _handle(self, src: int, kind: int) -> None:
        if kind != REQ:
            raise PeerError(f"rank {self.rank}: unexpected message kind {kind} from rank {src}")
        theirs = torch.empty(self._numel, dtype=self._dtype)
        with self.serve_lock:  # one averaging at a time on this worker
            self.ch.recv(theirs, src)
            with self.lock:
                mine = flatten(self.tensors, device="cpu")
                unflatten_(theirs - mine, self.tensors, add=0.5)
            self.ch.send(mine, src)
            if self.delay_s:
                simclock.sleep(self.delay_s)
        self.stats.add_exchange()
        self.stats.add_staleness(0)


class ADPSGDParams(AsyncParams):
    """``algorithm.params`` of ``adpsgd``."""

    pace: Literal["step", "free"] = Field("step", description="step: an active starts at most one averaging per "
                                                               "gradient step of its own; free: back to back")


class ADPSGD(AsyncAlgorithm):
    name = "adpsgd"

    def __init__(self, params, optimizer, comm, averager=None, *, seed: int = 0, pace: str, **kw) -> None:
        super().__init__(params, optimizer, comm, **kw)
        self.tensors = exchanged_tensors(self.params, averager)
        self.core: Optional[PairAveraging] = None
        if comm.world_size > 1:
            self.channel = open_channel(comm, adpsgd_pairs(comm.world_size), self.liveness)
            self.core = PairAveraging(self.channel, self.tensors, self.lock, self.stats, seed=seed,
                                      grad_steps=lambda: self.stats.grad_steps, per_step=pace == "step")

    def on_start(self, worker=None) -> None:
        super().on_start(worker)
        if self.core is not None:
            self.core.keepalive = self.keepalive

    def local_step(self) -> None:
        if self.core is not None:
            self.core.check()
        with self.lock:
            self.optimizer.step()
        if self.core is not None:
            self.core.notify_step()

    def begin_comm_round(self) -> None:
        if self.core is not None:
            self.core.begin_round()

    def end_comm_round(self) -> None:
        if self.core is not None:
            self.core.end_round()

    def leave(self, timeout_s: Optional[float]) -> None:
        if self.core is not None:
            self.core.leave(timeout_s)


def build(params: ADPSGDParams, ctx: BuildContext) -> ADPSGD:
    return ADPSGD(ctx.model.parameters(), ctx.optimizer, ctx.comm, ctx.policy,
                  seed=params.seed if params.seed is not None else ctx.seed, pace=params.pace,
                  round_steps=params.round_steps,
                  round_seconds=params.round_seconds, timeout_s=params.timeout_s)


SPECS = {"adpsgd": Spec(ADPSGDParams, build)}
