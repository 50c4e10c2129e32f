"""The stratified split and the class balancing of the feature stage: the rule, and its
reference computation in memory.

Every selected event has a ``sample_id`` (dense, in (file, entry) order) and two seeded hashes of
it: ``u`` (split) and ``v`` (balancing), 53-bit integer keys (:func:`hash_key`) or, divided by
2^53, uniform numbers in [0, 1) (:func:`hash_unit`). They are Spark's
``xxhash64(seed, salt, sample_id)`` (seed 42 chained over the three values, as
``pyspark.sql.functions.xxhash64`` computes it) masked to 53 bits, computed here with numpy;
:func:`spark_hash_unit` is the same value as a Spark column (to reproduce a split in Spark SQL;
the tests compare the two).

* Split: per class, events ordered by ``u``; the first ``floor(n * test_fraction)`` are test, the
  next ``floor(n * val_fraction)`` val, the rest train (exact counts, two thresholds per class).
* Balancing: in every split each class is cut to the smallest non-empty class of that split,
  keeping the events with the smallest ``v``.

Both come down to thresholds on the keys: a :class:`SplitRule` gives any event its split from
its sample_id and label alone, so the stage's tasks apply it while they write, and the driver
only chooses the thresholds (:mod:`pipeline.features.thresholds`, from the tasks' histograms of
the keys). :func:`assign` is the same rule computed in memory over every event (the reference the
tests compare the stage with).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

SPLITS: tuple[str, ...] = ("train", "val", "test")
_M64 = (1 << 64) - 1
_P1, _P2, _P3, _P4, _P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                           0x27D4EB2F165667C5)
_SPARK_SEED = 42
_MASK53 = (1 << 53) - 1


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _fmix(h: int) -> int:
    h ^= h >> 33
    h = (h * _P2) & _M64
    h ^= h >> 29
    h = (h * _P3) & _M64
    return h ^ (h >> 32)


def _round(acc: int, lane: int) -> int:
    return (_rotl((acc + lane * _P2) & _M64, 31) * _P1) & _M64


def _xxh64_bytes(data: bytes, seed: int) -> int:
    """XXH64 of ``data`` (Spark's ``XXH64.hashUnsafeBytes``), unsigned."""
    n, i = len(data), 0
    if n >= 32:
        v = [(seed + _P1 + _P2) & _M64, (seed + _P2) & _M64, seed, (seed - _P1) & _M64]
        while i <= n - 32:
            for k in range(4):
                v[k] = _round(v[k], int.from_bytes(data[i + 8 * k:i + 8 * k + 8], "little"))
            i += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M64
        for k in range(4):
            h = ((h ^ _round(0, v[k])) * _P1 + _P4) & _M64
    else:
        h = (seed + _P5) & _M64
    h = (h + n) & _M64
    while i <= n - 8:
        h = (_rotl(h ^ _round(0, int.from_bytes(data[i:i + 8], "little")), 27) * _P1 + _P4) & _M64
        i += 8
    if i + 4 <= n:
        h = (_rotl(h ^ ((int.from_bytes(data[i:i + 4], "little") * _P1) & _M64), 23) * _P2 + _P3) & _M64
        i += 4
    while i < n:
        h = (_rotl(h ^ ((data[i] * _P5) & _M64), 11) * _P1) & _M64
        i += 1
    return _fmix(h)


def _hash_int(value: int, seed: int) -> int:
    h = (seed + _P5 + 4) & _M64
    h ^= ((value & 0xFFFFFFFF) * _P1) & _M64
    return _fmix((_rotl(h, 23) * _P2 + _P3) & _M64)


def _hash_longs(values: np.ndarray, seed: int) -> np.ndarray:
    """Spark's ``XXH64.hashLong`` of every value (int64 array) with one seed, as uint64."""
    def rotl(x, r):
        return (x << np.uint64(r)) | (x >> np.uint64(64 - r))

    with np.errstate(over="ignore"):
        x = np.asarray(values, np.int64).view(np.uint64)
        h = np.full(x.shape, (seed + _P5 + 8) & _M64, np.uint64)
        h ^= rotl(x * np.uint64(_P2), 31) * np.uint64(_P1)
        h = rotl(h, 27) * np.uint64(_P1) + np.uint64(_P4)
        h ^= h >> np.uint64(33)
        h *= np.uint64(_P2)
        h ^= h >> np.uint64(29)
        h *= np.uint64(_P3)
        h ^= h >> np.uint64(32)
    return h


#: bits of a key (:func:`hash_key`)
KEY_BITS = 53


@functools.lru_cache(maxsize=64)
def _salted(seed: int, salt: str) -> int:
    """The xxhash64 state after ``seed`` and ``salt`` (``seed`` hashed as an int when it fits in
    32 bits, else as a long, as ``F.lit(seed)`` types it)."""
    h = _SPARK_SEED
    h = _hash_int(seed, h) if -(1 << 31) <= seed < (1 << 31) else int(_hash_longs(np.array([seed]), h)[0])
    return _xxh64_bytes(salt.encode("utf-8"), h)


def hash_key(sample_id: np.ndarray, seed: int, salt: str) -> np.ndarray:
    """The 53-bit key per sample_id: ``xxhash64(seed, salt, sample_id) & (2^53 - 1)`` with Spark's
    xxhash64, as int64."""
    return (_hash_longs(sample_id, _salted(seed, salt)) & np.uint64(_MASK53)).astype(np.int64)


def hash_unit(sample_id: np.ndarray, seed: int, salt: str) -> np.ndarray:
    """Uniform [0, 1) per sample_id: :func:`hash_key` / 2^53 (exact in float64)."""
    return hash_key(sample_id, seed, salt).astype(np.float64) / float(1 << KEY_BITS)


def spark_hash_unit(col, seed: int, salt: str):
    """:func:`hash_unit` as a Spark column expression."""
    from pyspark.sql import functions as F
    return F.xxhash64(F.lit(int(seed)), F.lit(salt), col).bitwiseAND(F.lit(_MASK53)).cast("double") / float(1 << 53)


@dataclass(frozen=True)
class SplitRule:
    """The split and balancing of any event from its sample_id and label: per label the key
    thresholds ``(t_test, t_val)`` on ``u`` (test if ``u <= t_test``, else val if ``u <= t_val``,
    else train; -1: none), and per (split index, label) a threshold on ``v`` above which balancing
    drops the event (absent: every event is kept)."""

    seed: int
    split_keys: dict = field(default_factory=dict)      # label -> (t_test, t_val)
    keep_keys: dict = field(default_factory=dict)       # (split index, label) -> t

    def splits(self, u: np.ndarray, label: int) -> np.ndarray:
        """The split index (into :data:`SPLITS`) of events of ``label`` with split keys ``u``."""
        t_test, t_val = self.split_keys.get(label, (-1, -1))
        return np.where(u <= t_test, SPLITS.index("test"),
                        np.where(u <= t_val, SPLITS.index("val"), SPLITS.index("train"))).astype(np.int8)

    def codes(self, sample_id: np.ndarray, label: int) -> np.ndarray:
        """Per event of ``label``: its split index, -1 where balancing drops it."""
        ids = np.asarray(sample_id, np.int64)
        split = self.splits(hash_key(ids, self.seed, "split"), label)
        limits = [(s, t) for (s, lab), t in self.keep_keys.items() if lab == label]
        if limits:
            v = hash_key(ids, self.seed, "balance")
            for s, t in limits:
                split[(split == s) & (v > t)] = -1
        return split

    def to_json(self) -> dict:
        return {"seed": self.seed, "split_keys": [[lab, *t] for lab, t in sorted(self.split_keys.items())],
                "keep_keys": [[s, lab, t] for (s, lab), t in sorted(self.keep_keys.items())]}

    @classmethod
    def from_json(cls, d: dict) -> "SplitRule":
        return cls(int(d["seed"]), {int(lab): (int(a), int(b)) for lab, a, b in d["split_keys"]},
                   {(int(s), int(lab)): int(t) for s, lab, t in d["keep_keys"]})


def _kth(values: np.ndarray, k: int) -> float:
    """The value at 1-based rank ``k`` of ``values`` (-1 for k = 0: nothing is at or below it)."""
    return float(np.partition(values, k - 1)[k - 1]) if k > 0 else -1.0


@dataclass
class Assignment:
    """Per selected event (in sample_id order): its split (index into :data:`SPLITS`) and whether
    it is kept; the thresholds that reproduce it on ``u``/``v``; the counts per (split, label)."""

    split: np.ndarray          # (n,) int8
    keep: np.ndarray           # (n,) bool
    split_thresholds: dict     # label -> (t_test, t_val): test if u <= t_test, else val if u <= t_val
    keep_thresholds: dict      # (split name, label) -> t: only events with v <= t are kept
    counts: dict               # (split name, label) -> events written


def assign(labels: np.ndarray, classes, seed: int, test_fraction: float, val_fraction: float,
           balance: bool) -> Assignment:
    """Split (and optionally balance) the events ``sample_id = 0..len(labels)-1`` with class
    ``labels`` (each one of ``classes``, which all get counts); see the module docstring."""
    n = len(labels)
    ids = np.arange(n, dtype=np.int64)
    u = hash_unit(ids, seed, "split")
    split = np.zeros(n, np.int8)
    thr, counts = {}, {}
    for lab in classes:
        mine = labels == lab
        n_lab = int(mine.sum())
        n_test, n_val = int(math.floor(n_lab * test_fraction)), int(math.floor(n_lab * val_fraction))
        t_test = _kth(u[mine], n_test)
        t_val = _kth(u[mine], n_test + n_val) if n_val else t_test
        split[mine & (u <= t_val)] = SPLITS.index("val")
        split[mine & (u <= t_test)] = SPLITS.index("test")
        thr[lab] = (t_test, t_val)
        counts[("test", lab)], counts[("val", lab)] = n_test, n_val
        counts[("train", lab)] = n_lab - n_test - n_val
    keep = np.ones(n, np.bool_)
    keep_thr: dict = {}
    if balance and n:
        v = hash_unit(ids, seed, "balance")
        present = sorted({lab for _, lab in counts})
        for s_i, s in enumerate(SPLITS):
            sizes = [counts[(s, lab)] for lab in present if counts[(s, lab)] > 0]
            m = min(sizes) if sizes else 0
            for lab in present:
                if counts[(s, lab)] > m:
                    mine = (labels == lab) & (split == s_i)
                    keep_thr[(s, lab)] = t = _kth(v[mine], m)
                    keep[mine & (v > t)] = False
                    counts[(s, lab)] = m
    return Assignment(split, keep, thr, keep_thr, counts)
