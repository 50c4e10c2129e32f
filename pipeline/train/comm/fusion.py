"""Tensor fusion: pack many tensors into a few flat buckets for one collective each.

Tensors are grouped by (dtype, device) and packed in order into buckets of at most
``bucket_bytes`` (a tensor larger than a bucket gets a bucket of its own). A backend reduces
each flat bucket with one collective and ``unpack_`` copies the results back in place.

Host staging: a collective library that cannot read device memory (a CPU-only Horovod build
with CUDA tensors) gets buckets whose flat vector lives in host memory. With a
:class:`HostStaging` the tensors of a bucket are copied straight into ONE (pinned, reused)
host buffer per bucket -- never one host copy per tensor -- and ``unpack_`` copies the
reduced values back to the device tensors.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...packing import consecutive_groups


class HostStaging:
    """Reusable host buffers, one per (dtype, device, bucket index); pinned when ``pin``.

    ``devices``: the device types whose buckets are staged (``("cuda",)`` in production).
    ``allocations`` counts host buffers created (a buffer is reused while its size fits).
    """

    def __init__(self, pin: bool = True, devices: tuple[str, ...] = ("cuda",)) -> None:
        self.pin, self.devices = bool(pin), tuple(devices)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.allocations = 0

    def wants(self, device: torch.device) -> bool:
        return device.type in self.devices

    def buffer(self, key: tuple, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
            self._buffers[key] = buf
            self.allocations += 1
        return buf[:numel]

    @staticmethod
    def sync(device: torch.device) -> None:
        """Wait for the asynchronous device-to-host copies of ``device`` (before a collective reads them)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


class Bucket:
    def __init__(self, tensors: list[torch.Tensor], staging: Optional[HostStaging] = None, key: tuple = ()):
        self.tensors = tensors
        self.staged = staging is not None and staging.wants(tensors[0].device)
        if self.staged:
            total = sum(t.numel() for t in tensors)
            self.flat = staging.buffer(key, total, tensors[0].dtype)
            off = 0
            for t in tensors:
                n = t.numel()
                self.flat[off:off + n].copy_(t.detach().reshape(-1), non_blocking=staging.pin)
                off += n
            staging.sync(tensors[0].device)
        elif len(tensors) > 1:
            self.flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        else:
            self.flat = tensors[0].detach().reshape(-1).clone()

    def unpack_(self) -> None:
        off = 0
        for t in self.tensors:
            n = t.numel()
            t.data.copy_(self.flat[off:off + n].view_as(t), non_blocking=self.staged)
            off += n


def make_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int,
                 staging: Optional[HostStaging] = None) -> list[Bucket]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    buckets: list[Bucket] = []
    for (dtype, device), ts in groups.items():
        packs = [[ts[i] for i in g] for g in consecutive_groups([t.numel() * t.element_size() for t in ts],
                                                                bucket_bytes)]
        buckets += [Bucket(p, staging, (dtype, str(device), i)) for i, p in enumerate(packs)]
    return buckets
