"""One digest of a list of tensors: SHA-1 of their values as one float64 vector on the CPU.

Used to compare parameters across ranks, backends and runs (equal digests = bitwise-equal
float64 views of the values). float64 holds every float32/float16/bfloat16 value exactly, so
two tensors of a lower precision have equal digests exactly when their values are equal.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch


def param_digest(tensors: Iterable[torch.Tensor]) -> str:
    """Hex SHA-1 of the concatenated values of ``tensors`` (as float64, on the CPU)."""
    ts = [t.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for t in tensors]
    flat = torch.cat(ts) if ts else torch.zeros(0, dtype=torch.float64)
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()
