"""A centre on rank 0 and the workers' access to it: shared by EA-wild and the parameter server.

* :class:`CentreHolder` -- the centre ``c`` on rank 0. Its serving threads
  (:class:`~..comm.round_server.RoundServer`, one per remote client) and rank 0's own training
  thread apply pushes one at a time under a mutex, with the algorithm's ``rule(c, payload)``;
  each push is answered with the centre after it (the pusher's next pull). ``order`` records
  the rank of every applied push; staleness = pushes of others between a rank's pull and push.
  ``locked``: a FIFO lock (:class:`FairLock`) makes pull-update-push one critical section
  (ACQUIRE -> c, PUSH -> the centre after it, release).
* :class:`CentreLink` -- a worker's access: in memory on rank 0, by messages elsewhere, sent
  and received on the link's own thread (one thread per pair group) while the training thread
  waits with the algorithm's liveness-aware ``wait``.
* :class:`CentreAlgorithm` -- the asynchronous algorithm around them: channels and groups at
  construction, the holder and the links at the first round, the centre's broadcast at round
  boundaries (on the host communicator) and its checkpoint state (rank 0's centre, every
  rank's last pull, whatever the rule keeps).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch

from ..comm import simclock
from ..comm.fusion import flatten, split_like
from ..comm.p2p import ACQUIRE, END, LEAVE, PUSH, P2PChannel, PeerError, open_channel
from ..comm.round_server import RoundServer
from .async_common import AsyncAlgorithm, check_group_size, exchanged_tensors, future_done
from .async_stats import AsyncStats

Rule = Callable[[torch.Tensor, torch.Tensor], None]  # rule(c, payload): update c in place
Wait = Callable[..., None]  # wait(done, peers, what, idle=True): see AsyncAlgorithm.wait


class FairLock:
    """A FIFO lock by tickets (threading.Lock is not fair); ``owner`` is the rank holding it."""

    def __init__(self) -> None:
        self._cv = simclock.condition()
        self._next = 0
        self._serving = 0
        self.owner: Optional[int] = None

    def ticket(self) -> int:
        with self._cv:
            self._next += 1
            return self._next - 1

    def turn(self, ticket: int, owner: int, timeout: Optional[float] = None) -> bool:
        """Wait up to ``timeout`` for ``ticket``'s turn; True once this caller holds the lock."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._serving == ticket, timeout):
                return False
            self.owner = owner
            return True

    def acquire(self, owner: int) -> None:
        self.turn(self.ticket(), owner)

    def release(self) -> None:
        with self._cv:
            self.owner = None
            self._serving += 1
            self._cv.notify_all()


def centre_pairs(world: int, group_size: int = 1) -> list[tuple[int, int]]:
    """The channels of a centre on rank 0: (0, j) for every other rank that pushes (every
    other rank; with groups of ``group_size``, every other group leader)."""
    return [(0, j) for j in range(group_size, world, group_size)]


class CentreHolder:
    """The centre ``c`` on rank 0 and its serving threads (see module docstring)."""

    def __init__(self, channel: Optional[P2PChannel], c0: torch.Tensor, rule: Rule, payload_numel: int,
                 locked: bool = False, stats: Optional[AsyncStats] = None, clients: Optional[list[int]] = None):
        self.ch, self.c, self.rule, self.locked = channel, c0.clone(), rule, bool(locked)
        self.payload_numel = int(payload_numel)
        self.stats = stats or AsyncStats()
        self.mutex = simclock.lock()
        self.fair = FairLock()
        self.version = 0
        self.order: list[int] = []
        self._pulled: dict[int, int] = {}
        self.round = 0
        if clients is None:
            clients = list(range(1, channel.world_size)) if channel is not None else []
        self.server = RoundServer(channel, clients, self._handle, "centre-holder") if clients else None

    # -- the centre (any thread)
    def snapshot(self) -> torch.Tensor:
        with self.mutex:
            return self.c.clone()

    def reset(self, c: torch.Tensor) -> None:
        with self.mutex:
            self.c.copy_(c)

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
    def begin_round(self) -> None:
        if self.server is not None:
            self.server.begin_round(self.round)

    def end_round(self, liveness=None, keepalive=None) -> None:
        if self.server is not None:
            self.server.end_round(self.round, liveness, keepalive)
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
        self.fair.acquire(src)
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


class SendingThread:
    """One daemon thread running submitted calls in order (a ThreadPoolExecutor's thread is joined
    at interpreter exit, which would hang a failed worker whose request waits on a frozen peer)."""

    def __init__(self, name: str) -> None:
        self._calls = simclock.queue()
        self._thread = simclock.thread(self._run, name=name)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)

    def submit(self, fn, *args) -> Future:
        fut = simclock.future()
        self._calls.put((fut, fn, args))
        return fut

    def stop(self) -> None:
        self._calls.put(None)


class CentreLink:
    """A worker's access to the centre (see module docstring). ``wait(done, peers, what)`` waits
    while the peers are alive; every remote request runs on the link's own thread."""

    def __init__(self, channel: Optional[P2PChannel], holder: Optional[CentreHolder], numel: int,
                 dtype: torch.dtype, stats: AsyncStats, wait: Wait) -> None:
        self.ch, self.holder, self.numel, self.dtype, self.stats = channel, holder, int(numel), dtype, stats
        self.wait = wait
        self.rank = channel.rank if channel is not None else 0
        self.round = 0
        self._sender: Optional[SendingThread] = None

    # -- remote requests, on the link's thread
    def _submit(self, fn, *args) -> Future:
        if self._sender is None:
            self._sender = SendingThread(f"centre-link-{self.rank}")
        return self._sender.submit(fn, *args)

    def _request(self, kind: int, payload: Optional[torch.Tensor] = None) -> torch.Tensor:
        self.ch.send_header(0, kind, self.round)
        if payload is not None:
            self.ch.send(payload, 0)
        out = torch.empty(self.numel, dtype=self.dtype)
        self.ch.recv(out, 0)
        return out

    def _result(self, fut: Future, what: str) -> torch.Tensor:
        self.wait(future_done(fut), [0], what)
        return fut.result()

    # -- lock-free
    def push_async(self, payload: torch.Tensor) -> Future:
        """A remote worker: push ``payload`` on the link's thread; the future's result is the centre
        after the push (the next pull). One push at a time: take the previous result first."""
        self.stats.add_exchange()
        return self._submit(self._request, PUSH, payload)

    def settle(self, fut: Future) -> torch.Tensor:
        """The reply to a push in flight."""
        return self._result(fut, "waiting for the centre holder's reply")

    def push(self, payload: torch.Tensor) -> torch.Tensor:
        """Apply ``payload`` at the holder; returns the centre after it (the next pull)."""
        if self.holder is not None:
            self.stats.add_exchange()
            return self.holder.apply(payload, self.rank)
        return self.settle(self.push_async(payload))

    # -- locked: acquire (the pull) ... push_locked (the push, then the release)
    def acquire(self) -> torch.Tensor:
        """Take the holder's lock; returns the centre (the pull)."""
        if self.holder is not None:
            fair, ticket = self.holder.fair, self.holder.fair.ticket()
            self.wait(lambda t: fair.turn(ticket, self.rank, t),
                      lambda: [fair.owner] if fair.owner not in (None, self.rank) else [],
                      "waiting for the centre lock")
            return self.holder.pull(self.rank)
        return self._result(self._submit(self._request, ACQUIRE), "waiting for the centre lock")

    def push_locked(self, payload: torch.Tensor) -> torch.Tensor:
        """Push under the lock taken by :meth:`acquire`, which the holder then releases."""
        self.stats.add_exchange()
        if self.holder is not None:
            try:
                return self.holder.apply(payload, self.rank)
            finally:
                self.holder.fair.release()
        return self._result(self._submit(self._request, PUSH, payload), "waiting for the centre holder's reply")

    # -- rounds
    def _send(self, kind: int, what: str, timeout_s: Optional[float] = None) -> None:
        fut = self._submit(self.ch.send_header, 0, kind, self.round)
        if timeout_s is None:
            self.wait(future_done(fut), [0], what, False)   # the round end counts its own idle time
        else:
            fut.result(timeout_s)

    def begin_round(self) -> None:
        if self.holder is not None:
            self.holder.begin_round()

    def end_round(self, liveness=None, keepalive=None) -> None:
        if self.holder is not None:
            self.holder.end_round(liveness, keepalive)
        elif self.ch is not None:
            self._send(END, "ending the round")
        self.round += 1

    def leave(self, timeout_s: Optional[float]) -> None:
        try:
            if self.holder is not None:
                self.holder.leave(timeout_s)
            elif self.ch is not None:
                self._send(LEAVE, "leaving", timeout_s)
        finally:
            if self._sender is not None:
                self._sender.stop()


class CentreAlgorithm(AsyncAlgorithm):
    """An asynchronous algorithm with a centre on rank 0 (EA-wild, the parameter server)."""

    locked = False

    def rule(self, c: torch.Tensor, payload: torch.Tensor) -> None:
        raise NotImplementedError

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
        pushes = comm.rank == self.leader
        self.channel = open_channel(comm, centre_pairs(m, self.group_size), self.liveness if pushes else None) \
            if m > 1 else None
        self.group = None
        if self.group_size > 1:  # every rank creates every group, in order (a world collective)
            groups = [self.host.new_group(range(g, g + self.group_size)) for g in range(0, m, self.group_size)]
            self.group = groups[comm.rank // self.group_size]
        self.holder: Optional[CentreHolder] = None
        self.link: Optional[CentreLink] = None
        self.pulled: Optional[torch.Tensor] = None
        self._restored: dict[str, Any] = {}

    def payload_numel(self) -> int:
        return self.numel + 1

    def _start(self) -> None:
        """The holder and the links, from the model (the centre starts from rank 0's broadcast
        model) or from the restored checkpoint state."""
        c0 = flatten(self.tensors, device="cpu")
        if self.comm.rank == 0:
            centre = self._restored.get("centre")
            self.holder = CentreHolder(self.channel, c0 if centre is None else centre, self.rule,
                                       self.payload_numel(), self.locked, self.stats, clients=self.clients)
        pushes = self.comm.rank == self.leader  # a group member (not leader) never talks to the centre
        self.link = CentreLink(self.channel if pushes else None, self.holder, self.numel, self.dtype, self.stats,
                               self.wait)
        pulled = self._restored.get("pulled")
        self.pulled = c0.clone() if pulled is None else pulled.clone()

    def begin_comm_round(self) -> None:
        if self.link is None:
            self._start()
        self.link.begin_round()

    def end_comm_round(self) -> None:
        self.link.end_round(self.liveness, self.keepalive)

    def leave(self, timeout_s: Optional[float]) -> None:
        if self.link is not None:
            self.link.leave(timeout_s)

    def _local_centre(self) -> torch.Tensor:
        if self.holder is not None:
            return self.holder.snapshot()
        centre = self._restored.get("centre")
        if centre is not None:
            return centre.clone()
        return self.pulled.clone() if self.pulled is not None else flatten(self.tensors, device="cpu")

    def centre_flat(self) -> torch.Tensor:
        """The centre on every rank (collective on the host communicator: rank 0 broadcasts it;
        call at a round boundary)."""
        c = self._local_centre()
        with self.host.stats_paused():
            self.host.broadcast_([c], root=0)
        return c

    def centre_tensors(self) -> list[torch.Tensor]:
        """The centre shaped like the exchanged tensors, on their devices (collective)."""
        return [v.to(t.device, t.dtype).clone() for t, v in zip(self.tensors, split_like(self.centre_flat(),
                                                                                          self.tensors))]

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain data only: rank 0's centre, this rank's last pull."""
        centre = self._local_centre() if self.comm.rank == 0 else None
        pulled = self.pulled if self.pulled is not None else self._restored.get("pulled")
        return {**super().state_dict(), "centre": centre, "pulled": None if pulled is None else pulled.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._restored = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                          for k, v in state.items() if k in ("centre", "pulled", "server_state")}
