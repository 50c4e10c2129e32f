"""Tensor fusion: pack many tensors into a few flat buckets for one collective each.

Tensors are grouped by (dtype, device) and packed in order into buckets of at most
``bucket_bytes`` (a tensor larger than a bucket gets a bucket of its own). A backend reduces
each flat bucket with one collective and ``unpack_`` copies the results back in place.
"""
from __future__ import annotations

from typing import Sequence

import torch


class Bucket:
    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if len(tensors) > 1 \
            else tensors[0].detach().reshape(-1).clone()

    def unpack_(self) -> None:
        off = 0
        for t in self.tensors:
            n = t.numel()
            t.data.copy_(self.flat[off:off + n].view_as(t))
            off += n


def make_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    buckets: list[Bucket] = []
    for ts in groups.values():
        cur: list[torch.Tensor] = []
        size = 0
        for t in ts:
            b = t.numel() * t.element_size()
            if cur and size + b > bucket_bytes:
                buckets.append(Bucket(cur))
                cur, size = [], 0
            cur.append(t)
            size += b
        if cur:
            buckets.append(Bucket(cur))
    return buckets
