"""Cutting a sequence of sized items into consecutive groups: the greedy rules of the pipeline
(fused communication buckets in ``train.comm.fusion``, LLF files in ``features.writers``; work
units into Spark tasks in ``features.plan`` and ``shards.route``)."""
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


def balanced_tasks(sizes: Sequence[float], k: int) -> list[int]:
    """The task of each item: consecutive items in ``min(k, len(sizes))`` tasks, each task ended
    once it has its share of the total size."""
    n = len(sizes)
    total = sum(sizes)
    k = max(1, min(n, k))
    out: list[int] = []
    done, task = 0.0, 0
    for e in sizes:
        # move on when this task has its share of what is left
        if out and done >= (task + 1) * total / k and task < k - 1 and n - len(out) >= k - task - 1:
            task += 1
        out.append(task)
        done += e
    return out
