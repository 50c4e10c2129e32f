"""Flat vectors of tensor lists, and tensor fusion: many tensors in a few buckets, one collective each.

:func:`flatten` / :func:`unflatten_` / :func:`split_like` are THE flattening of a list of
tensors (parameters, buffers, momentum) into one contiguous vector and back, used by every
algorithm that sends a model as one message or reduces it in one collective.

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


def flatten(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None,
            device: Optional[torch.device | str] = None) -> torch.Tensor:
    """One contiguous copy of ``tensors`` in ``dtype`` (default: the first tensor's) on ``device``
    (default: the first tensor's); an empty list gives an empty vector."""
    if not tensors:
        return torch.zeros(0, dtype=dtype or torch.float32, device=device)
    dtype = dtype or tensors[0].dtype
    device = tensors[0].device if device is None else device
    return torch.cat([t.detach().reshape(-1).to(device, dtype) for t in tensors])


def split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (as many as it covers, in order)."""
    out, o = [], 0
    for t in tensors:
        n = t.numel()
        if o + n > flat.numel():
            break
        out.append(flat[o:o + n].view(t.shape))
        o += n
    return out


def unflatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], add: Optional[float] = None,
               non_blocking: bool = False) -> None:
    """Copy ``flat`` back into ``tensors`` in place (the inverse of :func:`flatten`), or with ``add``
    add ``add * flat``; through ``.data`` (not seen by autograd), on each tensor's device and dtype."""
    total = sum(t.numel() for t in tensors)
    if total != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, the tensors {total}")
    for t, v in zip(tensors, split_like(flat, tensors)):
        if add is None:
            t.data.copy_(v, non_blocking=non_blocking)
        else:
            t.data.add_(v.to(t.device, t.dtype), alpha=add)


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
        else:
            self.flat = flatten(tensors)

    def unpack_(self) -> None:
        unflatten_(self.flat, self.tensors, non_blocking=self.staged)


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
