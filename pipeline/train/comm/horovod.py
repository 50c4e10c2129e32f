"""Horovod backend (``horovod.torch``, gloo or MPI underneath).

* ``allreduce_mean_``: tensors are fused into flat buckets (``fusion.py``) and the buckets
  are reduced with ONE ``grouped_allreduce_`` (op=Average) on the group's process set.
  ``broadcast_`` uses the same buckets (one broadcast per bucket).
* A CPU-only Horovod build cannot read CUDA memory: CUDA tensors are then staged through
  host memory, ONE pinned, reused host buffer per fused bucket (``fusion.HostStaging``).
  A CUDA build of Horovod (``HOROVOD_GPU_OPERATIONS=NCCL pip install horovod``) reduces the
  device buckets directly and no staging happens.
* Groups are Horovod *dynamic* process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1`` is set before
  ``hvd.init``); the world group is the global process set; asking twice for the same ranks
  returns the cached set.
* ``allgather_``: Horovod's allgather (the first dimension may differ between ranks);
  ``allgather_object`` sends JSON in it (the base class), never Horovod's pickling one.
* ``exchange`` is an ``alltoall`` with splits: this rank sends its flat payload only to
  ``partner`` (split = payload size there, 0 elsewhere). Horovod has no point-to-point
  send/recv, so every rank must call ``exchange`` in the same round (``collective_exchange``);
  a rank without a partner passes ``partner=None`` and sends nothing.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

from .base import Communicator, Group, nbytes
from .fusion import Bucket, HostStaging, make_buckets


class HorovodCommunicator(Communicator):
    collective_exchange = True

    def __init__(self, bucket_bytes: int = 4 << 20) -> None:
        super().__init__()
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init(process_sets="dynamic")
        self.bucket_bytes = int(bucket_bytes)
        self.staging = HostStaging(pin=True) if torch.cuda.is_available() and not hvd.cuda_built() else None
        self._sets: dict[tuple[int, ...], Any] = {}

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def world_size(self) -> int:
        return self.hvd.size()

    @property
    def local_rank(self) -> int:
        return self.hvd.local_rank()

    def world(self) -> Group:
        return Group(tuple(range(self.world_size)), self.hvd.global_process_set)

    def new_group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted(int(r) for r in ranks))
        if key == tuple(range(self.world_size)):
            return self.world()
        if key not in self._sets:
            self._sets[key] = self.hvd.add_process_set(list(key))
        return Group(key, self._sets[key])

    def _pset(self, group: Optional[Group]):
        return self.hvd.global_process_set if group is None or group.handle is None else group.handle

    def allreduce_mean_(self, tensors: Sequence[torch.Tensor], group: Optional[Group] = None) -> None:
        tensors = list(tensors)
        if not tensors or (group is not None and group.size == 1):
            return  # nothing to average: no collective, no traffic
        buckets = make_buckets(tensors, self.bucket_bytes, self.staging)
        with self._timed(nbytes(tensors)):
            self.hvd.grouped_allreduce_([b.flat for b in buckets], op=self.hvd.Average, process_set=self._pset(group))
        for b in buckets:
            b.unpack_()

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        tensors = list(tensors)
        buckets = make_buckets(tensors, self.bucket_bytes, self.staging)
        with self._timed(nbytes(tensors) if self.rank == root else 0):
            handles = [self.hvd.broadcast_async_(b.flat, root_rank=root) for b in buckets]
            for h in handles:
                self.hvd.synchronize(h)
        for b in buckets:
            b.unpack_()

    def exchange(self, tensors: Sequence[torch.Tensor], partner: Optional[int]) -> Optional[list[torch.Tensor]]:
        tensors = list(tensors)
        if partner is not None and not (0 <= partner < self.world_size) or partner == self.rank:
            raise ValueError(f"invalid exchange partner {partner} for rank {self.rank}")
        out: list[Optional[torch.Tensor]] = [None] * len(tensors)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        sent = nbytes(tensors) if partner is not None else 0
        with self._timed(sent):
            for dtype, idx in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
                dev = tensors[idx[0]].device
                flat = Bucket([tensors[i] for i in idx], self.staging, ("exchange", dtype)).flat
                splits = torch.zeros(self.world_size, dtype=torch.int32)
                if partner is not None:
                    splits[partner] = flat.numel()
                else:
                    flat = flat[:0]
                recv, recv_splits = self.hvd.alltoall(flat, splits=splits)
                if partner is None:
                    continue
                if int(recv_splits[partner]) != sum(tensors[i].numel() for i in idx) or recv.numel() != int(recv_splits.sum()):
                    raise RuntimeError(f"rank {self.rank}: exchange with {partner} got {recv_splits.tolist()} elements "
                                       "(partners must choose each other)")
                off = int(recv_splits[:partner].sum())
                for i in idx:
                    n = tensors[i].numel()
                    out[i] = recv[off:off + n].view_as(tensors[i]).to(dev, copy=True)
                    off += n
        return None if partner is None else out  # type: ignore[return-value]

    def barrier(self) -> None:
        with self._timed(0):
            self.hvd.barrier()

    def allgather_(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if tensor.dim() < 1:
            raise ValueError("allgather_ needs a tensor of at least one dimension")
        t = tensor.detach().contiguous()
        counts = self.hvd.allgather(torch.tensor([t.shape[0]], dtype=torch.int64)).tolist()
        with self._timed(nbytes([t])):
            out = self.hvd.allgather(t.cpu() if self.staging is not None and t.is_cuda else t)
        return [p.to(t.device) for p in torch.split(out, counts)]

    def shutdown(self) -> None:
        self.hvd.shutdown()
