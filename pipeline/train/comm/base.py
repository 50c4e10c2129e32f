"""The communication interface every training algorithm is written against.

Algorithms never import Horovod or torch.distributed: they get a :class:`Communicator`.
Backends (``horovod.py``, ``torch_dist.py``, ``local.py``) implement it.

Semantics
---------
* ``allreduce_mean_(tensors, group)``: in-place average over the ranks of ``group``
  (the whole world when ``group`` is None). Collective over the group's members.
  Backends fuse the list (one collective per bucket, not per tensor).
* ``new_group(ranks)``: collective over the *world* (every rank calls it with the same
  arguments in the same order); returns a :class:`Group` usable only by its members.
* ``exchange(tensors, partner)``: send ``tensors`` to ``partner`` and return the partner's
  tensors of the same shapes. ``partner=None`` sits the round out (returns None).
  ``collective_exchange`` tells whether every rank must call ``exchange`` in the same
  round (Horovod: it is an ``alltoall``) or only the two partners (torch.distributed).
* ``broadcast_(tensors, root)`` and ``barrier()``: world collectives.
* ``stats``: payload bytes this rank sent and seconds spent inside communication calls.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch


@dataclass(frozen=True)
class Group:
    """A set of ranks; ``handle`` is the backend's object (process set, ProcessGroup, ...)."""

    ranks: tuple[int, ...]
    handle: Any = field(default=None, compare=False, hash=False)

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class CommStats:
    bytes_sent: int = 0
    seconds: float = 0.0
    calls: int = 0

    def snapshot(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "comm_seconds": self.seconds, "comm_calls": self.calls}


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Communicator(ABC):
    """Abstract communicator. See the module docstring for the semantics."""

    collective_exchange: bool = True

    def __init__(self) -> None:
        self.stats = CommStats()

    # --- identity ---
    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    def local_rank(self) -> int:
        return self.rank

    def world(self) -> Group:
        return Group(tuple(range(self.world_size)))

    # --- collectives ---
    @abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Group: ...

    @abstractmethod
    def allreduce_mean_(self, tensors: Sequence[torch.Tensor], group: Optional[Group] = None) -> None: ...

    @abstractmethod
    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None: ...

    @abstractmethod
    def exchange(self, tensors: Sequence[torch.Tensor], partner: Optional[int]) -> Optional[list[torch.Tensor]]: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def allgather_object(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    @contextmanager
    def stats_paused(self):
        """Communication inside this block is not counted (e.g. evaluation bookkeeping)."""
        saved = CommStats(self.stats.bytes_sent, self.stats.seconds, self.stats.calls)
        try:
            yield
        finally:
            self.stats = saved

    # --- accounting helper for backends ---
    @contextmanager
    def _timed(self, sent_bytes: int = 0):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.seconds += time.perf_counter() - t0
            self.stats.bytes_sent += int(sent_bytes)
            self.stats.calls += 1
