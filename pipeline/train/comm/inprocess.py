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
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Optional, Sequence

import torch

from . import simclock
from .base import Communicator, Group, nbytes

_current = threading.local()


class PeerFailed(RuntimeError):
    """Another rank of the process failed: this rank's collective cannot complete."""


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

    def __init__(self, ranks: tuple[int, ...], timeout_s: float) -> None:
        self.ranks = ranks
        self.timeout_s = timeout_s
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
            if not self.cv.wait_for(lambda: self.generation != gen or self.broken, self.timeout_s) \
                    or self.generation == gen:
                self.broken = True
                self.cv.notify_all()
                raise PeerFailed(f"rank {rank}: another rank of the in-process world failed or did not arrive "
                                 f"within {self.timeout_s:.0f} s")
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

    def get(self, failed: threading.Event, timeout_s: float) -> Any:
        with self.cv:
            if not self.cv.wait_for(lambda: self.items or failed.is_set(), timeout_s) or not self.items:
                raise PeerFailed("another rank of the in-process world failed or did not answer")
            return self.items.popleft()


class InProcessWorld:
    """The meeting place of the ranks of one in-process run."""

    def __init__(self, size: int, timeout_s: float = 600.0, sim: Optional[simclock.Simulation] = None) -> None:
        if size < 1:
            raise ValueError(f"an in-process world needs at least one rank, got {size}")
        self.size, self.timeout_s = int(size), float(timeout_s)
        self.sim = sim
        self.messages = simclock.Mailboxes(sim) if sim is not None else None
        self._lock = threading.Lock()
        self._rooms: dict[tuple[int, ...], _Room] = {}
        self._mail: dict[tuple[int, int], _Mailbox] = {}
        self.failed = threading.Event()

    def room(self, ranks: tuple[int, ...]) -> _Room:
        with self._lock:
            if self.failed.is_set():
                raise PeerFailed("another rank of the in-process world failed")
            if ranks not in self._rooms:
                self._rooms[ranks] = _Room(ranks, self.timeout_s)
            return self._rooms[ranks]

    def mailbox(self, src: int, dst: int) -> _Mailbox:
        with self._lock:
            if (src, dst) not in self._mail:
                self._mail[(src, dst)] = _Mailbox()
            return self._mail[(src, dst)]

    def delay(self, nbytes_: int) -> None:
        """A simulated world: the calling rank waits out a transfer of ``nbytes_`` (virtual time)."""
        if self.sim is not None:
            self.sim.sleep(self.sim.transfer_seconds(nbytes_))

    def abort(self) -> None:
        """A rank failed: every rendezvous breaks, so no rank waits for it."""
        self.failed.set()
        with self._lock:
            rooms, boxes = list(self._rooms.values()), list(self._mail.values())
        for r in rooms:
            r.abort()
        for b in boxes:
            with b.cv:
                b.cv.notify_all()


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
        self.point_to_point = world.sim is not None   # the pair channels of a simulated world

    def p2p_channel(self, pairs, liveness=None):
        """This rank's pair channels (a simulated world only; see module docstring)."""
        from .p2p import SimChannel

        if self._world.sim is None:
            raise RuntimeError("point-to-point channels need an in-process world with a simulated clock")
        return SimChannel(self._world.messages, self._rank, self.world_size, pairs, liveness)

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
        return self._host

    def new_group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted(int(r) for r in ranks))
        if not key or key[0] < 0 or key[-1] >= self.world_size:
            raise ValueError(f"in-process world has ranks 0..{self.world_size - 1}, got group {list(ranks)}")
        return Group(key, self._world.room(key))

    def _room(self, group: Optional[Group]) -> _Room:
        if group is None:
            return self._world.room(tuple(range(self.world_size)))
        return group.handle if isinstance(group.handle, _Room) else self._world.room(group.ranks)

    def allreduce_mean_(self, tensors: Sequence[torch.Tensor], group: Optional[Group] = None) -> None:
        tensors = list(tensors)
        self.check_device("allreduce_mean_", tensors)
        if not tensors or (group is not None and group.size == 1):
            return
        room = self._room(group)
        with self._timed(nbytes(tensors)):
            parts = room.gather(self._rank, [t.detach().clone() for t in tensors])
            self._world.delay(nbytes(tensors))
        size = len(room.ranks)

        def mean() -> list[torch.Tensor]:   # on the tensors' devices (ranks may sit on different GPUs)
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
            parts = self._room(None).gather(self._rank, mine)
            self._world.delay(nbytes(tensors))
        if self._rank != root:
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
            self._world.mailbox(self._rank, partner).put([t.detach().clone() for t in tensors])
            try:
                got = self._world.mailbox(partner, self._rank).get(self._world.failed, self._world.timeout_s)
            except PeerFailed:
                raise PeerFailed(f"rank {self._rank}: rank {partner} of the in-process world failed or did not "
                                 "answer") from None
            self._world.delay(nbytes(tensors))
            return [g.to(t.device) for g, t in zip(got, tensors)]

    def barrier(self) -> None:
        with self._timed(0):
            self._room(None).gather(self._rank, None)
            self._world.delay(0)

    def allgather_(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.check_device("allgather_", [tensor])
        if tensor.dim() < 1:
            raise ValueError("allgather_ needs a tensor of at least one dimension")
        with self._timed(tensor.numel() * tensor.element_size()):
            parts = self._room(None).gather(self._rank, tensor.detach().clone())
            # JSON of allgather_object (bytes) costs the latency only: its length varies with the
            # wall-clock numbers it carries, which must not move the simulated clock
            self._world.delay(tensor.numel() * tensor.element_size() if tensor.is_floating_point() else 0)
        return [p.to(tensor.device, copy=True) for p in parts]
