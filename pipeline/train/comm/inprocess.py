"""The M workers as ranks of one process: a communicator over threads (the ``inprocess`` launcher).

Every worker runs the unchanged worker code (:func:`~pipeline.train.entry.worker_entry`) on a thread
of its own; the ranks meet in an :class:`InProcessWorld`, which holds one rendezvous per group of
ranks and one mailbox per ordered pair. What a collective computes is what the real backends
compute, in a fixed order, so every rank ends a collective with the same values:

* ``allreduce_mean_``: the ranks' tensors summed in rank order, then divided by the group's size
  (torch.distributed's ``all_reduce(SUM)`` followed by ``div_``; for two ranks the same floats),
  computed once per collective and device and copied by every rank;
* ``broadcast_``, ``allgather_``, ``barrier``: as their definitions say; ``exchange``: the partner's
  tensors, only the two partners calling (``collective_exchange`` False, as torch.distributed);
* ``stats``: the payload bytes the real backends count for the same call.

On CUDA (``device`` cuda: each rank's model on the GPU that ``local_rank % device_count`` names,
as under the local launcher) the collectives read and write the ranks' device tensors; a rank's
result is computed on its own device, whichever device its peers' tensors are on.

A world made with a :class:`~.simclock.Simulation` (``sim``) runs its ranks under the simulated
clock: one thread at a time, every rendezvous, mailbox and pair channel a simulated wait, and every
collective or message delivered after its virtual delay. Only such a world has point-to-point
channels (``point_to_point``; :meth:`InProcessCommunicator.p2p_channel`, the
:class:`~.p2p.SimChannel` of the asynchronous algorithms): their interleaving then depends on the
seed and the simulation's model only. Without it the ranks run freely on their threads (the
synchronous algorithms, whose results do not depend on the interleaving).

A rank that fails breaks every rendezvous, so the other ranks stop at their next collective with
:class:`PeerFailed` instead of waiting; the launcher reports the rank that failed first.

What a real run has and the ranks of one process would otherwise share or mix up:

* **rendezvous per process group**: a rendezvous is keyed by the communicator it belongs to (the
  world, or the host view of a CUDA world: torch.distributed's gloo group of its own) and its ranks,
  so collectives of two groups never meet even when their ranks are the same;
* **tensors that match**: a collective whose ranks pass tensors of other counts, shapes or dtypes
  fails on every rank with one line naming them (gloo refuses them too; summing them would broadcast);
* **no global random generator**: the ranks share torch's, numpy's and Python's global generators.
  After the model is built (each rank seeds them and draws its initial weights under one lock) nothing
  may draw from them: every progress beat compares them with their state after the build, and a rank
  that finds them moved (dropout, ``randperm`` without a generator, ``random.random()``) fails with
  one line. So every rank's checkpoint holds the state its own process would hold.

**Stalls** (:meth:`InProcessWorld.watch`, the in-process counterpart of the worker
:class:`~pipeline.train.watchdog.Watchdog`): every rank beats after each step, evaluation and
checkpoint; the launcher ends the run (:meth:`InProcessWorld.end`) when a rank has not beaten for
``stall_s`` seconds of wall clock, whether it is blocked in a collective or outside one. Ending
breaks every rendezvous and mailbox, ends the simulated clock's run, and makes every later wait and
beat of the run raise :class:`RunEnded`; the launcher then interrupts a rank thread that still does
not return (:func:`interrupt`). A rendezvous has no time limit of its own unless ``timeout_s`` is
given (wall clock; a simulated world's waits have none: the simulation's own deadlock detection and
the launcher's stall limit end them).
"""
from __future__ import annotations

import collections
import ctypes
import threading
import time
from typing import Any, Optional, Sequence

import torch

from ...errors import ConfigError
from . import simclock
from .base import Communicator, Group, nbytes
from .inprocess_checks import check_match, global_rng_state, same_rng
from .simcore import RunEnded

_current = threading.local()


class PeerFailed(RuntimeError):
    """Another rank of the process failed: this rank's collective cannot complete."""


class GlobalRandomUsed(ConfigError):
    """A rank drew from the process's global random generators, which the ranks share."""


class _Ended(RunEnded, PeerFailed):
    """The run was ended (a stall, another rank's failure): raised in a rank thread to unwind it."""


def interrupt(thread: threading.Thread) -> bool:
    """Raise :class:`RunEnded` in ``thread`` at its next Python instruction (CPython's
    ``PyThreadState_SetAsyncExc``): a rank blocked in Python code (a sleep loop, a poll) unwinds; one
    blocked inside a C call returns to Python first. True when the thread was found."""
    if thread.ident is None or not thread.is_alive():
        return False
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Ended))
    return n == 1


class _Collected(list):
    """One generation of a rendezvous: the payloads in rank order, and what is computed from them
    once for every member (:meth:`once`: an allreduce's mean, summed once instead of by each rank)."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self._lock = threading.Lock()
        self._done: dict[Any, Any] = {}

    def once(self, key: Any, compute) -> Any:
        with self._lock:
            if key not in self._done:
                self._done[key] = compute()
            return self._done[key]


class _Room:
    """One group's rendezvous: each member puts its payload, all take the list in rank order."""

    def __init__(self, world: "InProcessWorld", ranks: tuple[int, ...]) -> None:
        self.world = world
        self.ranks = ranks
        self.timeout_s = world.timeout_s if world.sim is None else None   # virtual waits: no limit
        self.cv = simclock.condition()
        self.slots: list[Any] = [None] * len(ranks)
        self.arrived = 0
        self.generation = 0
        self.out: _Collected = _Collected([])
        self.broken = False

    def gather(self, rank: int, payload: Any) -> _Collected:
        i = self.ranks.index(rank)
        with self.cv:
            if self.broken:
                self.world.check(rank)
                raise PeerFailed(f"rank {rank}: another rank of the in-process world failed")
            self.slots[i] = payload
            self.arrived += 1
            if self.arrived == len(self.ranks):     # the last one in: everyone's payloads, in rank order
                self.out, self.slots = _Collected(self.slots), [None] * len(self.ranks)
                self.arrived = 0
                self.generation += 1
                self.cv.notify_all()
                return self.out
            gen = self.generation
            self.world.waiting.add(rank)
            try:
                arrived = self.cv.wait_for(lambda: self.generation != gen or self.broken, self.timeout_s)
            finally:
                self.world.waiting.discard(rank)
            if not arrived or self.generation == gen:
                self.broken = True
                self.cv.notify_all()
                self.world.check(rank)
                raise PeerFailed(f"rank {rank}: another rank of the in-process world failed" +
                                 (f" or did not arrive within {self.timeout_s:g} s" if not arrived else ""))
            return self.out      # the next generation cannot complete before this rank joins it

    def abort(self) -> None:
        with self.cv:
            self.broken = True
            self.cv.notify_all()


class _Mailbox:
    """Payloads from one rank to another, in order."""

    def __init__(self) -> None:
        self.cv = simclock.condition()
        self.items: collections.deque = collections.deque()

    def put(self, item: Any) -> None:
        with self.cv:
            self.items.append(item)
            self.cv.notify_all()

    def get(self, failed: threading.Event, timeout_s: Optional[float]) -> Any:
        with self.cv:
            if not self.cv.wait_for(lambda: self.items or failed.is_set(), timeout_s) or not self.items:
                raise PeerFailed("another rank of the in-process world failed or did not answer")
            return self.items.popleft()


class InProcessWorld:
    """The meeting place of the ranks of one in-process run. ``timeout_s``: a wall-clock limit on each
    wait of a free-thread world (None: none; the launcher's stall limit ends a stalled run);
    ``stall_s``: the seconds without a beat after which :meth:`stalled` names a rank (0: never)."""

    def __init__(self, size: int, timeout_s: Optional[float] = None, sim: Optional[simclock.Simulation] = None,
                 stall_s: float = 0.0) -> None:
        if size < 1:
            raise ValueError(f"an in-process world needs at least one rank, got {size}")
        self.size = int(size)
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.sim = sim
        self.messages = simclock.Mailboxes(sim) if sim is not None else None
        self._lock = threading.Lock()
        self._rooms: dict[tuple, _Room] = {}
        self._mail: dict[tuple[int, int], _Mailbox] = {}
        self.failed = threading.Event()
        self.ended: Optional[str] = None          # why the run was ended (end())
        self.stall_s = float(stall_s or 0)
        self.beats = [time.monotonic()] * self.size
        self.done: set[int] = set()               # ranks whose thread returned
        self.waiting: set[int] = set()            # ranks waiting in a rendezvous of a free-thread world
        self._rng: Optional[tuple] = None         # the global generators' state after the model's build

    def room(self, ranks: tuple[int, ...], space: str = "world") -> _Room:
        """The rendezvous of ``ranks`` on the communicator ``space`` (the world, or a CUDA world's host view)."""
        with self._lock:
            if self.failed.is_set():
                raise PeerFailed("another rank of the in-process world failed")
            key = (space, ranks)
            if key not in self._rooms:
                self._rooms[key] = _Room(self, ranks)
            return self._rooms[key]

    # ------------------------------------------------------------------ progress and stalls
    def watch(self, rank: int) -> "_Watch":
        """Rank ``rank``'s progress beats (what the worker's watchdog is in a process of its own)."""
        return _Watch(self, rank)

    def beat(self, rank: int) -> None:
        self.check(rank)
        self.beats[rank] = time.monotonic()
        state = global_rng_state()
        if self._rng is None:
            self._rng = state
        elif not same_rng(state, self._rng):
            raise GlobalRandomUsed(
                f"rank {rank}: the process's global random generators (torch, numpy or random) were drawn from "
                "during training (dropout, randperm or a draw without a generator of its own?); on launcher "
                "inprocess the ranks share them, so the run would differ from a real one: use launcher local")

    def finished(self, rank: int) -> None:
        self.done.add(rank)

    def stalled(self, now: Optional[float] = None) -> Optional[tuple[int, float]]:
        """(rank, seconds) of the rank that stalls, else None. A rank stalls when it has not beaten for
        ``stall_s`` while blocked outside a collective, or when no rank that is still running has (they
        all wait, in collectives or not); a rank that waits in a collective for a peer that still beats
        is waiting, not stalled. A simulated world runs one thread at a time, so it stalls as a whole:
        the rank named is the one whose thread holds the clock."""
        if not self.stall_s:
            return None
        now = time.monotonic() if now is None else now
        running = [r for r in range(self.size) if r not in self.done]
        late = {r: now - self.beats[r] for r in running if now - self.beats[r] >= self.stall_s}
        if not late:
            return None
        if self.sim is not None:
            if len(late) < len(running):
                return None           # another rank beats: the simulation is moving
            holder = self.sim.current.name if self.sim.current is not None else ""
            r = int(holder[5:]) if holder.startswith("rank-") and holder[5:].isdigit() else min(late)
            return (r, late.get(r, max(late.values())))
        outside = [r for r in late if r not in self.waiting]
        if not outside and len(late) < len(running):
            return None               # they wait for a rank that still beats
        r = max(outside or late, key=lambda k: late[k])
        return (r, late[r])

    def check(self, rank: int) -> None:
        """Raise :class:`RunEnded` when the run was ended or another rank failed."""
        if self.ended is not None:
            raise _Ended(f"rank {rank}: the in-process run was ended: {self.ended}")
        if self.failed.is_set():
            raise _Ended(f"rank {rank}: another rank of the in-process world failed")

    def end(self, why: str) -> None:
        """End the run: every rendezvous breaks, every later wait and beat raises :class:`RunEnded`."""
        self.ended = self.ended or why
        if self.sim is not None:
            self.sim.end(why)
        else:
            self.abort()

    def mailbox(self, src: int, dst: int) -> _Mailbox:
        with self._lock:
            if (src, dst) not in self._mail:
                self._mail[(src, dst)] = _Mailbox()
            return self._mail[(src, dst)]

    def now(self) -> float:
        """Virtual seconds in a simulated world (0 otherwise)."""
        return self.sim.now if self.sim is not None else 0.0

    def delay(self, t0: float, rank: int, op: str, ranks, *args, own_bytes: bool = False) -> None:
        """A simulated world: the calling rank, in collective ``op`` over ``ranks`` since virtual time
        ``t0``, waits out what the cost model (``sim.cost``) says ``op(ranks, *args)`` costs; the ledger
        gets the rank's time since ``t0`` and the operation's bytes once (every rank's own bytes when
        ``own_bytes``: a pairwise exchange)."""
        if self.sim is not None:
            cost = getattr(self.sim.cost, op)(*((ranks,) if op != "p2p" else ()), *args)
            self.sim.sleep(cost.seconds)
            first = own_bytes or rank == min(ranks)
            self.sim.ledger.comm(rank, self.sim.now - t0, cost if first else None)

    def abort(self) -> None:
        """A rank failed: every rendezvous breaks, so no rank waits for it (called by rank threads)."""
        self.failed.set()
        with self._lock:
            rooms, boxes = list(self._rooms.values()), list(self._mail.values())
        for r in rooms:
            r.abort()
        for b in boxes:
            with b.cv:
                b.cv.notify_all()


class _Watch:
    """The interface of :class:`~pipeline.train.watchdog.Watchdog` over a world's beats."""

    active = True

    def __init__(self, world: InProcessWorld, rank: int) -> None:
        self.world, self.rank = world, rank

    def beat(self) -> None:
        self.world.beat(self.rank)

    def failing(self, grace_s: float = 0.0) -> None:
        """Nothing to arm: the launcher bounds the run's end."""

    def stop(self) -> None:
        """Nothing to stop: the launcher notes the rank's end when its thread returns."""


def bind(world: InProcessWorld, rank: int) -> None:
    """Make the calling thread rank ``rank`` of ``world`` (what ``make_communicator("inprocess")``
    then returns a communicator for)."""
    _current.world, _current.rank = world, int(rank)


def current(device_kind: str = "cpu") -> "InProcessCommunicator":
    world = getattr(_current, "world", None)
    if world is None:
        raise RuntimeError("the inprocess communicator is made on a thread the inprocess launcher started")
    return InProcessCommunicator(world, _current.rank, device=device_kind)


class InProcessCommunicator(Communicator):
    collective_exchange = False

    def __init__(self, world: InProcessWorld, rank: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if not 0 <= rank < world.size:
            raise ValueError(f"rank {rank} outside the in-process world of {world.size}")
        self._world, self._rank = world, int(rank)
        self.device = torch.device(device)
        self._host: Optional[InProcessCommunicator] = None
        self._space = "world"        # whose rendezvous: the world's, or the host view's (its own group)
        self.point_to_point = world.sim is not None   # the pair channels of a simulated world

    def p2p_channel(self, pairs, liveness=None):
        """This rank's pair channels (a simulated world only; see module docstring)."""
        from .p2p import SimChannel

        if self._world.sim is None:
            raise RuntimeError("point-to-point channels need an in-process world with a simulated clock")
        return SimChannel(self._world.messages, self._rank, self.world_size, pairs, liveness)

    def stall_watch(self):
        """This rank's progress beats for the launcher's stall limit (see module docstring)."""
        return self._world.watch(self._rank)

    def liveness(self, dead_after_s: float):
        """No heartbeats: the ranks share one process, and a rank that fails breaks the world."""
        return None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.size

    def host(self) -> Communicator:
        if self.device.type == "cpu":
            return self
        if self._host is None:
            self._host = InProcessCommunicator(self._world, self._rank, "cpu")
            self._host.stats = self.stats      # one account of the worker's traffic
            self._host._space = "host"         # torch.distributed: a gloo group of its own
        return self._host

    def new_group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted(int(r) for r in ranks))
        if not key or key[0] < 0 or key[-1] >= self.world_size:
            raise ValueError(f"in-process world has ranks 0..{self.world_size - 1}, got group {list(ranks)}")
        return Group(key, self._world.room(key, self._space))

    def _room(self, group: Optional[Group]) -> _Room:
        if group is None:
            return self._world.room(tuple(range(self.world_size)), self._space)
        return group.handle if isinstance(group.handle, _Room) else self._world.room(group.ranks, self._space)

    def allreduce_mean_(self, tensors: Sequence[torch.Tensor], group: Optional[Group] = None) -> None:
        tensors = list(tensors)
        self.check_device("allreduce_mean_", tensors)
        if not tensors or (group is not None and group.size == 1):
            return
        room = self._room(group)
        with self._timed(nbytes(tensors)):
            t0 = self._world.now()
            parts = room.gather(self._rank, [t.detach().clone() for t in tensors])
            self._world.delay(t0, self._rank, "allreduce", room.ranks, nbytes(tensors))
        size = len(room.ranks)

        def mean() -> list[torch.Tensor]:   # on the tensors' devices (ranks may sit on different GPUs)
            check_match("allreduce_mean_", parts, room.ranks)
            out = []
            for i in range(len(tensors)):
                acc = parts[0][i].to(tensors[i].device, copy=True)
                for p in parts[1:]:
                    acc += p[i].to(tensors[i].device)
                if acc.is_floating_point() or acc.is_complex():
                    acc.div_(size)
                else:
                    acc = torch.div(acc, size, rounding_mode="floor")
                out.append(acc)
            return out

        devices = tuple(str(t.device) for t in tensors)
        for t, acc in zip(tensors, parts.once(("mean", devices), mean)):   # summed once per device
            t.copy_(acc)

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        tensors = list(tensors)
        self.check_device("broadcast_", tensors)
        mine = [t.detach().clone() for t in tensors] if self._rank == root else None
        with self._timed(nbytes(tensors) if self._rank == root else 0):
            t0 = self._world.now()
            parts = self._room(None).gather(self._rank, mine)
            self._world.delay(t0, self._rank, "broadcast", range(self.world_size), nbytes(tensors), root)
        if self._rank != root:
            check_match("broadcast_", [tensors if r == self._rank else p for r, p in enumerate(parts)],
                        list(range(self.world_size)), root)
            for t, src in zip(tensors, parts[root]):
                t.copy_(src)

    def exchange(self, tensors: Sequence[torch.Tensor], partner: Optional[int]) -> Optional[list[torch.Tensor]]:
        tensors = list(tensors)
        self.check_device("exchange", tensors)
        if partner is None:
            return None
        if not (0 <= partner < self.world_size) or partner == self._rank:
            raise ValueError(f"invalid exchange partner {partner} for rank {self._rank}")
        with self._timed(nbytes(tensors)):
            t0 = self._world.now()
            self._world.mailbox(self._rank, partner).put([t.detach().clone() for t in tensors])
            try:
                got = self._world.mailbox(partner, self._rank).get(self._world.failed, self._world.timeout_s)
            except PeerFailed:
                raise PeerFailed(f"rank {self._rank}: rank {partner} of the in-process world failed or did not "
                                 "answer") from None
            self._world.delay(t0, self._rank, "p2p", (self._rank, partner), self._rank, partner, nbytes(tensors),
                              own_bytes=True)
        check_match("exchange", [tensors, got], [self._rank, partner])
        return [g.to(t.device) for g, t in zip(got, tensors)]

    def barrier(self) -> None:
        with self._timed(0):
            t0 = self._world.now()
            self._room(None).gather(self._rank, None)
            self._world.delay(t0, self._rank, "barrier", range(self.world_size))

    def allgather_(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.check_device("allgather_", [tensor])
        if tensor.dim() < 1:
            raise ValueError("allgather_ needs a tensor of at least one dimension")
        with self._timed(tensor.numel() * tensor.element_size()):
            t0 = self._world.now()
            parts = self._room(None).gather(self._rank, tensor.detach().clone())
            # JSON of allgather_object (bytes) costs the latency only: its length varies with the
            # wall-clock numbers it carries, which must not move the simulated clock
            self._world.delay(t0, self._rank, "allgather", range(self.world_size),
                              tensor.numel() * tensor.element_size() if tensor.is_floating_point() else 0)
        return [p.to(tensor.device, copy=True) for p in parts]
