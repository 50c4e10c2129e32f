"""Keyed bijections of ``[0, n)`` computed per element: a balanced Feistel network over the
smallest even number of bits that holds ``n``, with cycle walking (an element mapped outside
``[0, n)`` is mapped again until it lands inside), so that any task can compute where one sample
goes without the whole permutation (docs/shards.md)."""
from __future__ import annotations

import numpy as np

ROUNDS = 4
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        x = (x + _GOLDEN) ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def round_keys(seed: int) -> np.ndarray:
    """The :data:`ROUNDS` round keys of a seed."""
    return np.random.SeedSequence([int(seed), 7]).generate_state(ROUNDS, dtype=np.uint64)


def _encrypt(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << np.uint64(half)) | right


def permute(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The image of each ``x`` in ``[0, n)`` under the bijection of ``[0, n)`` keyed by ``seed``
    (int64 in, int64 out)."""
    x = np.asarray(x, np.int64)
    if n <= 1:
        return np.zeros_like(x)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    keys = round_keys(seed)
    y = _encrypt(x.astype(np.uint64), half, keys)
    out = y >= np.uint64(n)
    while out.any():                           # cycle walking: at most a few steps (the domain is < 4n)
        y[out] = _encrypt(y[out], half, keys)
        out = y >= np.uint64(n)
    return y.astype(np.int64)
