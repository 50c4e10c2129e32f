"""EA-wild (Wongpanich et al. 2020, Algorithm 1): asynchronous elastic averaging, lock-free centre.

A centre variable ``c`` lives on the holder, rank 0 (a thread of its process serves the other
workers; rank 0's own training thread reaches it in memory). Every ``tau`` local steps worker
j does, with ``alpha = lr * rho`` (or a fixed ``alpha``)::

    x_j <- x_j - alpha * (x_j - c_j)          c_j: the centre it pulled
    push x_j;  holder, on arrival:  c <- c + alpha * (x_j - c);  reply c  (the next pull)

(the gradient part ``x_j <- x_j - lr * g_j`` is the base optimizer's step). The holder applies
arrivals one after the other **without a lock between a worker's pull and its push**: other
workers' pushes may land in between (staleness = centre updates between the pull and the
push). A remote worker's push runs on its link's sending thread
(:meth:`CentreLink.push_async`) while the worker computes its next gradient; the reply is taken
just before the next elastic move, its only use, so the update rule is that of a blocking push
and the round trip no longer idles the worker. ``lock=True`` is the locked asynchronous EASGD
of Zhang et al. 2015 that EA-wild improves on: the pull, the elastic update and the push are one
critical section on the holder (ACQUIRE -> c, PUSH -> release), so every worker sees the newest
centre and the result equals the sequential EASGD updates in the holder's grant order
(``CentreHolder.order``); the waiting it costs is measured (idle fraction).

The holder (:class:`CentreHolder`) serves every other rank from its own thread on its own
pair channel; pushes are applied one at a time under a mutex. The holder logic (with
:class:`CentreLink`, a worker's access) is shared with the
asynchronous parameter server (``async_ps``), which pushes gradients instead of models.
Rounds end as described in :mod:`.async_common`: each non-holder sends END; the holder serves
until it heard END (or LEAVE) from all. The final model is the world average of the workers
(the round loop's last average); the centre is evaluated too (:meth:`EAWild.evaluation_tensors`).

Grouping (the seed's option; ``group_size`` G > 1, M divisible by G): ranks ``[gG, (g+1)G)`` form
group g and are synchronous: every ``tau`` local steps the group averages its models in one
allreduce on its own process group, and only its leader (rank ``gG``) talks to the centre. The
leader folds the elastic move into that allreduce (it contributes ``G alpha c_l`` on top of the
members' ``(1 - alpha) x_i``), so the whole group leaves it at ``x <- (1 - alpha) mean_i(x_i) +
alpha c_l`` and the leader pushes that. G = 1 is EA-wild as above; G = M is one pusher (rank 0, in
memory) with an allreduce of all workers. In time mode a grouped round ends only at an exchange,
when the clock of any group member says so (a flag carried in the same allreduce), so the members
always take the same number of steps.

Drag compensation (``compensate: true``; off by default, i.e. Algorithm 1 as published): the
elastic moves conserve the sum of the workers and the centre except for the centre's share, so
once the gaps have settled the system moves at ``1 / f`` of the workers' gradient speed, with
``f = 1 + G / (M (1 - alpha)) + alpha s G / M`` (M workers, G per group, s pushes between a
pull and the next push; :func:`drag_factor`, derivation in docs/async.md): ``1/f`` is 0.74 for
M = 4 and alpha 0.1 (0.78 with the lock). With the option every worker's gradient step is
multiplied by ``f`` (the optimizer's learning rate for that step), so the system moves at
AR-SGD's speed per sample, as the linear scaling rule makes the other algorithms do.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
from pydantic import model_validator
from pydantic import Field

from ..comm.p2p import ACQUIRE, END, LEAVE, PUSH, P2PChannel, PeerError
from . import BuildContext, Spec
from .async_common import (AsyncAlgorithm, AsyncParams, AsyncStats, RoundServer, check_group_size, copy_flat_,
                           exchanged_tensors, flat_copy)


class FairLock:
    """A FIFO lock: waiters are served in arrival order (threading.Lock is not fair)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._held = False

    def acquire(self) -> None:
        me = object()
        with self._cv:
            self._queue.append(me)
            while self._held or self._queue[0] is not me:
                self._cv.wait()
            self._queue.popleft()
            self._held = True

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()


Rule = Callable[[torch.Tensor, torch.Tensor], None]  # rule(c, payload): update c in place


def centre_pairs(world: int, group_size: int = 1) -> list[tuple[int, int]]:
    """The channels of a centre on rank 0: (0, j) for every other rank that pushes (every
    other rank; with groups of ``group_size``, every other group leader)."""
    return [(0, j) for j in range(group_size, world, group_size)]


class CentreHolder:
    """The centre ``c`` on rank 0 and its serving threads (one per other rank)."""

    def __init__(self, channel: Optional[P2PChannel], c0: torch.Tensor, rule: Rule, payload_numel: int,
                 locked: bool = False, stats: Optional[AsyncStats] = None,
                 clients: Optional[list[int]] = None) -> None:
        self.ch, self.c, self.rule, self.locked = channel, c0.clone(), rule, bool(locked)
        self.payload_numel = int(payload_numel)
        self.stats = stats or AsyncStats()
        self.mutex = threading.Lock()
        self.fair = FairLock()
        self.version = 0
        self.order: list[int] = []  # rank of every applied push, in order
        self._pulled: dict[int, int] = {}
        self.round = 0
        if clients is None:
            clients = list(range(1, channel.world_size)) if channel is not None else []
        remotes = list(clients)
        self.server = RoundServer(channel, remotes, self._handle, "centre-holder") if remotes else None

    # -- the centre (any thread)
    def pull(self, src: int) -> torch.Tensor:
        with self.mutex:
            self._pulled[src] = self.version
            return self.c.clone()

    def apply(self, payload: torch.Tensor, src: int) -> torch.Tensor:
        with self.mutex:
            stale = self.version - self._pulled.get(src, self.version)
            self.rule(self.c, payload)
            self.version += 1
            self.order.append(src)
            self._pulled[src] = self.version
            reply = self.c.clone()
        self.stats.add_staleness(stale)
        return reply

    # -- main thread of rank 0
    def check(self) -> None:
        if self.server is not None and self.server.error is not None:
            e = self.server.error
            raise PeerError(str(e)) from e

    def begin_round(self) -> None:
        if self.server is not None:
            self.server.begin_round(self.round)

    def end_round(self, timeout_s: float) -> None:
        if self.server is not None:
            self.server.end_round(self.round, timeout_s)
        self.round += 1

    def leave(self, timeout_s: Optional[float]) -> None:
        if self.server is not None:
            self.server.leave(timeout_s)

    # -- serving threads (one per remote rank)
    def _handle(self, src: int, kind: int) -> None:
        if kind == PUSH:
            buf = torch.empty(self.payload_numel, dtype=self.c.dtype)
            self.ch.recv(buf, src)
            self.ch.send(self.apply(buf, src), src)
        elif kind == ACQUIRE:
            self._serve_locked(src)
        else:
            raise PeerError(f"rank 0: unexpected message kind {kind} from rank {src}")

    def _serve_locked(self, src: int) -> None:
        self.fair.acquire()
        try:
            self.ch.send(self.pull(src), src)
            kind = self.ch.recv_header(src)[0]
            if kind != PUSH:
                raise PeerError(f"rank 0: rank {src} holds the centre lock but sent kind {kind}")
            buf = torch.empty(self.payload_numel, dtype=self.c.dtype)
            self.ch.recv(buf, src)
            reply = self.apply(buf, src)
        finally:
            self.fair.release()
        self.ch.send(reply, src)


class CentreLink:
    """A worker's access to the centre: in memory on rank 0, by messages elsewhere."""

    def __init__(self, channel: Optional[P2PChannel], holder: Optional[CentreHolder], numel: int,
                 dtype: torch.dtype, stats: AsyncStats) -> None:
        self.ch, self.holder, self.numel, self.dtype, self.stats = channel, holder, int(numel), dtype, stats
        self.rank = channel.rank if channel is not None else 0
        self.round = 0
        self._pool: Optional[ThreadPoolExecutor] = None

    def push(self, payload: torch.Tensor) -> torch.Tensor:
        """Lock-free: apply ``payload`` at the holder, return the centre after it (the next pull)."""
        self.stats.add_exchange()
        if self.holder is not None:
            return self.holder.apply(payload, self.rank)
        self.ch.send_header(0, PUSH, self.round)
        self.ch.send(payload, 0)
        return self._reply()

    def push_async(self, payload: torch.Tensor) -> Future:
        """:meth:`push` on this link's sending thread (a remote worker): returns at once; the
        future's result is the centre after the push. One push at a time: wait for the previous
        result first."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"centre-push-{self.rank}")
        return self._pool.submit(self.push, payload)

    def locked_update(self, update: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Locked: c = pull under the holder's lock, payload = update(c), push, release; returns c after."""
        self.stats.add_exchange()
        if self.holder is not None:
            self.holder.fair.acquire()
            try:
                c = self.holder.pull(self.rank)
                return self.holder.apply(update(c), self.rank)
            finally:
                self.holder.fair.release()
        self.ch.send_header(0, ACQUIRE, self.round)
        c = self._reply()
        payload = update(c)
        self.ch.send_header(0, PUSH, self.round)
        self.ch.send(payload, 0)
        return self._reply()

    def _reply(self) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=self.dtype)
        self.ch.recv(out, 0)
        return out

    def begin_round(self) -> None:
        if self.holder is not None:
            self.holder.begin_round()

    def end_round(self, timeout_s: float) -> None:
        if self.holder is not None:
            self.holder.end_round(timeout_s)
        elif self.ch is not None:
            self.ch.send_header(0, END, self.round)
        self.round += 1

    def leave(self, timeout_s: Optional[float]) -> None:
        if self.holder is not None:
            self.holder.leave(timeout_s)
        elif self.ch is not None:
            self.ch.send_header(0, LEAVE, self.round)
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def drag_factor(alpha: float, workers: int, group_size: int = 1, locked: bool = False) -> float:
    """The factor ``f`` by which EA-wild's centre slows the system's mean-field velocity (to
    ``1/f`` of the workers' gradient speed; docs/async.md, "Why EA-wild trails in samples"):
    ``f = 1 + G / (M (1 - alpha)) + alpha * s * G / M`` with P = M/G pushers and ``s`` the pushes
    that land between a pusher's pull and its push: ``P - 1`` lock-free (each reply is the pull of
    the next push, and the other pushers take their turn in between), 0 with the lock."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"EA-wild drag compensation needs a moving rate alpha in (0, 1), got {alpha:g}")
    pushers = workers // group_size
    stale = 0 if locked else pushers - 1
    return 1.0 + group_size / (workers * (1.0 - alpha)) + alpha * stale * group_size / workers


def elastic_rule(c: torch.Tensor, payload: torch.Tensor) -> None:
    """payload = [x_j, alpha]:  c <- c + alpha * (x_j - c)."""
    c.add_(payload[:-1] - c, alpha=float(payload[-1]))


class EAWildParams(AsyncParams):
    """``algorithm.params`` of ``eawild``."""

    tau: int = Field(1, ge=1, description="local steps between two pushes")
    alpha: Optional[float] = Field(None, gt=0, lt=1, description="moving rate (default 0.1 when rho is not given)")
    rho: Optional[float] = Field(None, gt=0, description="elastic coefficient: alpha = lr * rho")
    lock: bool = Field(False, description="locked asynchronous EASGD (pull-update-push atomic) instead of EA-wild")
    group_size: int = Field(1, ge=1, description="workers per synchronous group (one leader pushes); divides the "
                                                 "number of workers; 1 = no grouping")
    compensate: bool = Field(False, description="multiply each gradient step by drag_factor(alpha, M, G), so the "
                                                "workers and the centre move at AR-SGD's speed per sample")

    @model_validator(mode="after")
    def _one(self):
        if self.alpha is not None and self.rho is not None:
            raise ValueError("give alpha or rho, not both")
        return self


class CentreAlgorithm(AsyncAlgorithm):
    """An asynchronous algorithm with a centre on rank 0 (EA-wild, asynchronous PS)."""

    rule: Rule = staticmethod(elastic_rule)
    locked = False

    def __init__(self, params, optimizer, comm, averager=None, *, group_size: int = 1, **kw) -> None:
        super().__init__(params, optimizer, comm, **kw)
        self.tensors = exchanged_tensors(self.params, averager)
        self.numel = sum(t.numel() for t in self.tensors)
        self.dtype = self.tensors[0].dtype
        m = comm.world_size
        check_group_size(group_size, m)
        self.group_size = int(group_size)
        self.leader = comm.rank - comm.rank % self.group_size  # the rank of this group that talks to the centre
        self.clients = [j for _, j in centre_pairs(m, self.group_size)]
        self.channel = P2PChannel(centre_pairs(m, self.group_size), self.timeout_s) if m > 1 else None
        self.group = None
        if self.group_size > 1:  # every rank creates every group, in order (a world collective)
            groups = [comm.new_group(range(g, g + self.group_size)) for g in range(0, m, self.group_size)]
            self.group = groups[comm.rank // self.group_size]
        self.holder: Optional[CentreHolder] = None
        self.link: Optional[CentreLink] = None

    def payload_numel(self) -> int:
        return self.numel + 1

    def begin_comm_round(self) -> None:
        if self.link is None:  # first round: the centre starts from the (broadcast) initial model
            c0 = flat_copy(self.tensors)
            if self.comm.rank == 0:
                self.holder = CentreHolder(self.channel, c0, self.rule, self.payload_numel(), self.locked, self.stats,
                                           clients=self.clients)
            pushes = self.comm.rank == self.leader  # a group member (not leader) never talks to the centre
            self.link = CentreLink(self.channel if pushes else None, self.holder, self.numel, self.dtype, self.stats)
            self.pulled = c0
        self.link.begin_round()

    def end_comm_round(self) -> None:
        self.link.end_round(self.timeout_s)

    def leave(self, timeout_s: Optional[float]) -> None:
        if self.link is not None:
            self.link.leave(timeout_s)

    def centre_flat(self) -> torch.Tensor:
        """The centre on every rank (collective: rank 0 broadcasts it; call at a round boundary)."""
        c = (self.holder.pull(0) if self.holder is not None else
             (self.pulled.clone() if self.link is not None else flat_copy(self.tensors)))
        with self.comm.stats_paused():
            self.comm.broadcast_([c], root=0)
        return c

    def centre_tensors(self) -> list[torch.Tensor]:
        """The centre shaped like the exchanged tensors (collective)."""
        c = self.centre_flat()
        out, o = [], 0
        for t in self.tensors:
            out.append(c[o:o + t.numel()].view_as(t).to(t.device, t.dtype).clone())
            o += t.numel()
        return out


class EAWild(CentreAlgorithm):
    name = "eawild"

    def __init__(self, params, optimizer, comm, averager=None, *, tau: int = 1, alpha: Optional[float] = None,
                 rho: Optional[float] = None, lock: bool = False, group_size: int = 1, compensate: bool = False,
                 **kw) -> None:
        super().__init__(params, optimizer, comm, averager, group_size=group_size, **kw)
        self._group_due = False
        self.tau, self.rho, self.locked, self.compensate = int(tau), rho, bool(lock), bool(compensate)
        self._inflight: Optional[Future] = None   # a remote worker's push whose reply has not been taken
        self._alpha = 0.1 if alpha is None and rho is None else alpha

    @property
    def alpha(self) -> float:
        if self.rho is not None:
            return float(self.optimizer.param_groups[0]["lr"]) * self.rho
        return float(self._alpha)

    def local_step(self) -> None:
        a = self.alpha   # before the step's learning rate is scaled (alpha = lr * rho)
        with self.lock:
            if self.compensate and self.comm.world_size > 1:
                f = drag_factor(a, self.comm.world_size, self.group_size, self.locked)
                lrs = [g["lr"] for g in self.optimizer.param_groups]
                for g in self.optimizer.param_groups:
                    g["lr"] = g["lr"] * f
                try:
                    self.optimizer.step()
                finally:
                    for g, lr in zip(self.optimizer.param_groups, lrs):
                        g["lr"] = lr
            else:
                self.optimizer.step()
        if self.comm.world_size == 1 or (self.step_count + 1) % self.tau:
            return
        elastic = self._elastic if self.group is None else self._group_elastic
        if self.comm.rank != self.leader:
            elastic(None, a)  # a group member: the group's allreduce only
        elif self.locked:  # the wait inside the critical section (the group's allreduce too) is timed once
            update = (lambda c: elastic(c, a)) if self.group is None else (lambda c: self._group_elastic(c, a, False))
            self.pulled = self._timed(lambda: self.link.locked_update(update))
        elif self.group is None and self.holder is None:  # a remote pusher: the reply comes while it computes
            if self._inflight is not None:
                self.pulled = self._timed(self._settle)
            self._inflight = self.link.push_async(elastic(self.pulled, a))
        else:
            payload = elastic(self.pulled, a)
            self.pulled = self._timed(lambda: self.link.push(payload))

    def _settle(self) -> torch.Tensor:
        """The reply to the push in flight (the centre after it): the next pull."""
        f, self._inflight = self._inflight, None
        return f.result()   # the channel's own timeout ends a push whose holder is gone (PeerError)

    def end_comm_round(self) -> None:
        if self._inflight is not None:   # before END goes out on the same channel
            self.pulled = self._settle()
        super().end_comm_round()

    def leave(self, timeout_s: Optional[float]) -> None:
        if self._inflight is not None:
            self._settle()
        super().leave(timeout_s)

    def _round_due(self) -> bool:
        """Grouped time-mode rounds end at an exchange that any member's clock asked for."""
        if self.group is None or self.round_seconds is None:
            return super()._round_due()
        due, self._group_due = self._group_due, False
        return due

    def extra_evaluations(self) -> dict[str, list[torch.Tensor]]:
        """The centre is scored too (summary ``centre_test_accuracy``); the final model is the average."""
        return {"centre": self.centre_tensors()} if self.comm.world_size > 1 else {}

    def _elastic(self, c: torch.Tensor, a: float) -> torch.Tensor:
        """x <- x - a (x - c); returns the push payload [x, a]."""
        with self.lock:
            x = flat_copy(self.tensors)
            x.add_(x - c.to(x.dtype), alpha=-a)
            copy_flat_(self.tensors, x)
        return torch.cat([x, torch.tensor([a], dtype=x.dtype)])

    def _group_elastic(self, c: Optional[torch.Tensor], a: float, timed: bool = True) -> torch.Tensor:
        """One allreduce of the group: x <- (1 - a) mean(x_i) + a c (c: the leader's pulled centre);
        returns the push payload [x, a]. Carries the time-mode round flag (any member due)."""
        import time

        g = self.group_size
        due = self.round_seconds is not None and time.perf_counter() - self._round_t0 >= self.round_seconds
        with self.lock:
            x = flat_copy(self.tensors)
        v = torch.cat([x * (1 - a), torch.tensor([g * float(due)], dtype=x.dtype)])
        if c is not None:
            v[:-1].add_(c.to(x.dtype), alpha=g * a)
        v = v.to(self.tensors[0].device)  # the world backend's device (NCCL: the GPU)
        if timed:
            self._timed(lambda: self.comm.allreduce_mean_([v], group=self.group))
        else:
            self.comm.allreduce_mean_([v], group=self.group)
        v = v.cpu()
        self._group_due = bool(v[-1] > 0)
        x = v[:-1]
        with self.lock:
            copy_flat_(self.tensors, x)
        return torch.cat([x, torch.tensor([a], dtype=x.dtype)])

    def _timed(self, fn):
        import time

        t0 = time.perf_counter()
        out = fn()
        self.stats.add_idle(time.perf_counter() - t0)
        return out


def build(params: EAWildParams, ctx: BuildContext) -> EAWild:
    return EAWild(ctx.model.parameters(), ctx.optimizer, ctx.comm, ctx.policy, tau=params.tau, alpha=params.alpha,
                  rho=params.rho, lock=params.lock, group_size=params.group_size,
                  compensate=params.compensate, round_steps=params.round_steps,
                  round_seconds=params.round_seconds, timeout_s=params.timeout_s)


SPECS = {"eawild": Spec(EAWildParams, build)}
