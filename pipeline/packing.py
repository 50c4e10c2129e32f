"""Cutting a sequence of sized items into consecutive groups: the one greedy rule of the pipeline
(fused communication buckets in ``train.comm.fusion``, LLF files in ``features.writers``)."""
from __future__ import annotations

from typing import Sequence


def consecutive_groups(sizes: Sequence[float], limit: float) -> list[list[int]]:
    """The indices of ``sizes``, in order, cut into groups: a group closes when the next item
    would take it above ``limit`` (an item larger than ``limit`` forms a group of its own)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    size = 0.0
    for i, b in enumerate(sizes):
        if cur and size + b > limit:
            groups.append(cur)
            cur, size = [], 0.0
        cur.append(i)
        size += b
    if cur:
        groups.append(cur)
    return groups
