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
* ``allgather_(tensor)``: every rank's tensor (the first dimension may differ between ranks).
* ``allgather_object(obj)``: every rank's ``obj``, which must be plain data (dict, list, tuple,
  str, int, float, bool, None): it travels as JSON in a uint8 tensor, never pickled. Tuples
  come back as lists and dict keys as strings (JSON's rules).
* ``stats``: payload bytes this rank sent and seconds spent inside communication calls.

Devices: ``device`` is where the communicator's collectives read and write tensors (the
model's device for torch.distributed: NCCL reads only CUDA memory, gloo only host memory;
None: any device, as Horovod stages CUDA tensors itself). Every collective checks it and
raises :class:`DeviceMismatch` (one line: the operation, the tensor's device, the declared one)
instead of a backend's crash or a silent copy. ``host()`` is a communicator over the same ranks
for host (CPU) tensors: the asynchronous algorithms' centre, metrics and group averages.

Capabilities: ``point_to_point`` -- the backend can open the pair channels of
:mod:`.p2p` (torch.distributed), which the asynchronous algorithms need.
"""
from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

PLAIN = (str, int, float, bool, type(None))


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


class DeviceMismatch(ValueError):
    """A collective got a tensor on another device than its communicator's."""


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_plain(obj: Any, where: str = "obj") -> None:
    if isinstance(obj, PLAIN):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, PLAIN):
                raise TypeError(f"allgather_object: {where} has a key of type {type(k).__name__}: only plain data "
                                "(dict, list, str, int, float, bool, None) travels between workers, never a pickled "
                                "object")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(f"allgather_object: {where} is a {type(obj).__module__}.{type(obj).__name__} object: only plain "
                    "data (dict, list, str, int, float, bool, None) travels between workers, never a pickled object")


def encode_plain(obj: Any) -> bytes:
    """``obj`` as JSON bytes; TypeError (one line, naming where) for anything but plain data."""
    _check_plain(obj)
    return json.dumps(obj, separators=(",", ":")).encode()


class Communicator(ABC):
    """Abstract communicator. See the module docstring for the semantics."""

    collective_exchange: bool = True
    point_to_point: bool = False
    device: Optional[torch.device] = None

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

    # --- devices ---
    def bind_device(self, device: torch.device | str) -> None:
        """Declare the device of this communicator's tensors (the worker's, once it is resolved); a
        communicator that accepts any device (``device`` None: Horovod) keeps accepting any."""
        if self.device is not None:
            self.device = torch.device(device)

    def check_device(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        """Raise :class:`DeviceMismatch` unless every tensor is on :attr:`device` (see module docstring)."""
        want = self.device
        if want is None:
            return
        for t in tensors:
            d = t.device
            if d.type != want.type or (want.index is not None and d.index is not None and d.index != want.index):
                raise DeviceMismatch(f"{type(self).__name__}.{op}: a tensor on {d}, but this communicator's "
                                     f"collectives run on {want}")

    def staging_device(self) -> torch.device:
        """Where tensors made for a collective of this communicator are created."""
        return self.device if self.device is not None else torch.device("cpu")

    def host(self) -> "Communicator":
        """A communicator over the same ranks for host (CPU) tensors (this one when it is)."""
        return self

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

    @abstractmethod
    def allgather_(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's plain-data ``obj`` (JSON in a uint8 tensor; see module docstring)."""
        raw = encode_plain(obj)
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.staging_device())
        return [json.loads(p.cpu().numpy().tobytes()) for p in self.allgather_(t)]

    def shutdown(self) -> None:
        pass

    @contextmanager
    def stats_paused(self):
        """Communication inside this block is not counted (e.g. evaluation bookkeeping)."""
        st = self.stats
        saved = (st.bytes_sent, st.seconds, st.calls)
        try:
            yield
        finally:   # in place: a host view shares its communicator's counters
            st.bytes_sent, st.seconds, st.calls = saved

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
