"""What the in-process ranks check as gloo and separate processes would: that the ranks' tensors of
one collective match (count, shapes, dtypes), and that no rank draws from the global random
generators the threads of one process share."""
from __future__ import annotations

import random
from typing import Optional, Sequence

import numpy as np
import torch


def global_rng_state() -> tuple:
    """The state of torch's, numpy's and Python's global generators (numpy's key copied)."""
    _, key, pos, _, _ = np.random.get_state()
    return torch.get_rng_state(), key.copy(), pos, random.getstate()


def same_rng(a: tuple, b: tuple) -> bool:
    """Two :func:`global_rng_state` results are the same state."""
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] and a[3] == b[3]


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def check_match(op: str, parts: Sequence, ranks: Sequence[int], root: Optional[int] = None) -> None:
    """Every rank's tensors of one collective have the same count, shapes and dtypes (``root``: the
    others must match the root's); else ValueError naming the first rank and tensor that differ."""
    ref_i = ranks.index(root) if root is not None else 0
    ref = parts[ref_i]
    for i, mine in enumerate(parts):
        if mine is None or i == ref_i:
            continue
        if len(mine) != len(ref):
            raise ValueError(f"{op}: rank {ranks[i]} passed {len(mine)} tensors, rank {ranks[ref_i]} {len(ref)}: "
                             "every rank must pass the same tensors (gloo refuses the call too)")
        for k, (a, b) in enumerate(zip(mine, ref)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"{op}: tensor {k} is {_describe(a)} on rank {ranks[i]} but {_describe(b)} on rank "
                                 f"{ranks[ref_i]}: every rank must pass the same shapes and dtypes (gloo refuses "
                                 "the call too)")
