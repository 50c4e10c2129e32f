"""torch.distributed backend (gloo for CPU tensors, NCCL for CUDA tensors).

* ``allreduce_mean_``: fused flat buckets, one async ``all_reduce(SUM)`` per bucket on the
  group's ProcessGroup, then divided by the group size (gloo has no AVG op).
* ``new_group``: ``dist.new_group(ranks)``, which is collective over the world: every rank
  calls it with the same ranks in the same order (cached per rank tuple).
* ``exchange``: ``batch_isend_irecv`` with exactly the two partners involved
  (``collective_exchange = False``: other ranks need not call it).

The backend follows the worker's resolved device (``device_kind``, see ``device.py``), never
whether CUDA is merely visible: a ``device=cpu`` run on a GPU host uses gloo end to end.
The process group is initialised from the environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) that torchrun / TorchDistributor / the local launcher set.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .base import Communicator, Group, nbytes
from .device import DeviceKind, torch_backend
from .fusion import make_buckets


class TorchDistCommunicator(Communicator):
    collective_exchange = False

    def __init__(self, bucket_bytes: int = 4 << 20, device_kind: DeviceKind = "cpu", timeout_s: int = 600) -> None:
        super().__init__()
        self.bucket_bytes = int(bucket_bytes)
        self.backend = torch_backend(device_kind)
        if not dist.is_initialized():
            dist.init_process_group(backend=self.backend, timeout=timedelta(seconds=timeout_s))
        self._groups: dict[tuple[int, ...], Any] = {}

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank))

    def new_group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted(int(r) for r in ranks))
        if key == tuple(range(self.world_size)):
            return Group(key, None)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key))
        return Group(key, self._groups[key])

    def allreduce_mean_(self, tensors: Sequence[torch.Tensor], group: Optional[Group] = None) -> None:
        tensors = list(tensors)
        if not tensors or (group is not None and group.size == 1):
            return  # nothing to average: no collective, no traffic
        handle = None if group is None else group.handle
        size = self.world_size if group is None else group.size
        buckets = make_buckets(tensors, self.bucket_bytes)
        with self._timed(nbytes(tensors)):
            works = [dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=handle, async_op=True) for b in buckets]
            for w in works:
                w.wait()
        for b in buckets:
            b.flat.div_(size)
            b.unpack_()

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        tensors = list(tensors)
        buckets = make_buckets(tensors, self.bucket_bytes)
        with self._timed(nbytes(tensors) if self.rank == root else 0):
            works = [dist.broadcast(b.flat, src=root, async_op=True) for b in buckets]
            for w in works:
                w.wait()
        for b in buckets:
            b.unpack_()

    def exchange(self, tensors: Sequence[torch.Tensor], partner: Optional[int]) -> Optional[list[torch.Tensor]]:
        if partner is None:
            return None
        if not (0 <= partner < self.world_size) or partner == self.rank:
            raise ValueError(f"invalid exchange partner {partner} for rank {self.rank}")
        tensors = list(tensors)
        sends = [t.detach().contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, partner) for t in sends] + [dist.P2POp(dist.irecv, r, partner) for r in recvs]
        with self._timed(nbytes(tensors)):
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return recvs

    def barrier(self) -> None:
        with self._timed(0):
            dist.barrier()

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
