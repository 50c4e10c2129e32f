"""Choosing the split and balancing thresholds of the feature stage on the driver from the tasks'
histograms of the keys: an exact k-th smallest key per query, without any per-event array on the
driver.

The events of a class are given as sample_id ranges (one per chunk: the driver knows them from
the per-chunk counts), so the tasks recompute every key from its sample_id
(:func:`~pipeline.features.split.hash_key`) and nothing is read from the data. A query asks for
the ``k``-th smallest key among the events of one label (for balancing: of one label and split).
Each round is one Spark job over the ranges: a query whose candidates are more than
``values_limit`` gets, from every task, a histogram of the next ``bits`` bits of the keys under its
current prefix, and the driver narrows the prefix to the bin holding rank ``k``; a query with at
most ``values_limit`` candidates gets their keys and is resolved. Every query takes at least one
histogram round, so what the driver receives per query is a few histograms and at most
``values_limit`` keys, whatever the number of events (at 10^6 events per class: one histogram
round of 1,024 bins, then about 1,000 keys)."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from ..spark import default_parallelism, spark_task, task_frame
from .split import KEY_BITS, SPLITS, SplitRule, hash_key

#: bits per histogram round; candidates at or below which the keys themselves are sent
HIST_BITS = 10
VALUES_LIMIT = 4096
#: sample_ids hashed at a time in a task
_BLOCK = 1 << 20
_OUT_DDL = "query int, hist binary, keys binary"


@dataclass
class Query:
    """The ``k``-th smallest ``salt`` key among the events of ``label`` (and of ``split``, an index
    into SPLITS, when set); ``count`` candidates. The result: ``key`` and ``at_or_below``, the
    candidates with a key <= ``key`` (``k`` unless keys tie)."""

    salt: str
    label: int
    split: Optional[int]
    k: int
    count: int
    prefix: int = 0         # the candidates left are those whose top `bits` bits equal `prefix`
    bits: int = 0
    below: int = 0          # candidates under the prefix's range
    rank: int = 0           # rank of the answer among those left (set from k)
    left: int = 0           # candidates left
    key: Optional[int] = None
    at_or_below: Optional[int] = None

    def spec(self, keys: bool) -> list:
        return [self.salt, self.label, -1 if self.split is None else self.split, self.prefix, self.bits, int(keys)]


def _next_bits(bits: int, hist_bits: int) -> int:
    return min(hist_bits, KEY_BITS - bits)


def hash_partition(batches: Iterator, *, seed: int, rule: dict, specs: str, hist_bits: int) -> Iterator:
    """The ``mapInArrow`` function of a round: per task, its sample_id ranges (``start, stop,
    label``) hashed block by block; per query (``specs``: salt, label, split, prefix, bits, keys?)
    a histogram (int32: a task counts fewer than 2^31 events) of the next bits of the candidates'
    keys, or their keys."""
    import pyarrow as pa

    rule_ = SplitRule.from_json(rule)
    queries = json.loads(specs)
    hists = {i: np.zeros(1 << _next_bits(q[4], hist_bits), np.int32) for i, q in enumerate(queries) if not q[5]}
    keys: dict = {i: [] for i, q in enumerate(queries) if q[5]}
    for batch in batches:
        d = batch.to_pydict()
        for starts, stops, labels in zip(d["starts"], d["stops"], d["labels"]):
            for a, b, lab in zip(starts, stops, labels):
                mine = [(i, q) for i, q in enumerate(queries) if q[1] == lab]
                for lo in range(a, b, _BLOCK) if mine else ():
                    ids = np.arange(lo, min(b, lo + _BLOCK), dtype=np.int64)
                    _hash_block(ids, lab, mine, seed, rule_, hists, keys, hist_bits)
    for i in sorted(hists) + sorted(keys):
        h = hists[i].tobytes() if i in hists else None
        k = np.sort(np.concatenate(keys[i])).tobytes() if i in keys and keys[i] else (b"" if i in keys else None)
        yield pa.RecordBatch.from_pydict({"query": [i], "hist": [h], "keys": [k]},
                                         schema=pa.schema([("query", pa.int32()), ("hist", pa.binary()),
                                                           ("keys", pa.binary())]))


def _hash_block(ids, label, mine, seed, rule: SplitRule, hists, keys, hist_bits) -> None:
    u = hash_key(ids, seed, "split")
    v = hash_key(ids, seed, "balance") if any(q[0] == "balance" for _, q in mine) else None
    split = rule.splits(u, label) if any(q[2] >= 0 for _, q in mine) else None
    for i, (salt, _, s, prefix, bits, want_keys) in mine:
        k = u if salt == "split" else v
        m = np.ones(len(ids), np.bool_) if s < 0 else split == s
        if bits:
            m &= (k >> (KEY_BITS - bits)) == prefix
        sel = k[m]
        if want_keys:
            keys[i].append(sel)
        else:
            nb = _next_bits(bits, hist_bits)
            hists[i] += np.bincount((sel >> (KEY_BITS - bits - nb)) & ((1 << nb) - 1), minlength=1 << nb)


def _pieces(ranges: list[tuple[int, int, int]], tasks: int) -> list[tuple]:
    """The (start, stop, label) ranges cut into ``tasks`` pieces of about equal numbers of ids."""
    total = sum(b - a for a, b, _ in ranges)
    share = max(1, -(-total // max(1, tasks)))
    out, cur, room = [], [], share
    for a, b, lab in ranges:
        while a < b:
            take = min(b - a, room)
            cur.append((a, a + take, lab))
            a, room = a + take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], share
    if cur:
        out.append(cur)
    return [tuple(list(x) for x in zip(*p)) for p in out]


def select(spark, ranges: list[tuple[int, int, int]], queries: list[Query], rule: SplitRule,
           hist_bits: int = HIST_BITS, values_limit: int = VALUES_LIMIT) -> int:
    """Resolve every query (sets ``key`` and ``at_or_below``); ``rule`` gives the splits the
    balancing queries filter on. Returns the bytes received from the tasks."""
    for q in queries:
        if not 1 <= q.k <= q.count:
            raise ValueError(f"rank {q.k} out of 1..{q.count}")
        q.rank, q.left = q.k, q.count
    pieces = _pieces(ranges, default_parallelism(spark))
    received, first = 0, True
    while [q for q in queries if q.key is None]:
        todo = [q for q in queries if q.key is None]
        want_keys = [not first and q.left <= values_limit for q in todo]
        fn = functools.partial(hash_partition, seed=rule.seed, rule=rule.to_json(), hist_bits=hist_bits,
                               specs=json.dumps([q.spec(w) for q, w in zip(todo, want_keys)]))
        df = task_frame(spark, pieces, "starts array<long>, stops array<long>, labels array<long>")
        res = df.mapInArrow(spark_task(fn), _OUT_DDL).toArrow()
        received += res.nbytes
        _narrow(todo, want_keys, res, hist_bits)
        first = False
    return received


def _narrow(todo: list[Query], want_keys: list[bool], res, hist_bits: int) -> None:
    """One round's results folded into the queries: a histogram narrows the prefix to the bin of
    the answer; the keys give the answer."""
    col = res.to_pydict()
    for i, (q, keys) in enumerate(zip(todo, want_keys)):
        rows = [j for j, x in enumerate(col["query"]) if x == i]
        if keys:
            k = np.sort(np.concatenate([np.frombuffer(col["keys"][j], np.int64) for j in rows] or [np.zeros(0, np.int64)]))
            if len(k) != q.left:
                raise RuntimeError(f"threshold selection: {len(k)} keys, {q.left} expected (input changed?)")
            q.key = int(k[q.rank - 1])
            q.at_or_below = q.below + int(np.searchsorted(k, q.key, side="right"))
            continue
        h = np.sum([np.frombuffer(col["hist"][j], np.int32).astype(np.int64) for j in rows], axis=0)
        if int(h.sum()) != q.left:
            raise RuntimeError(f"threshold selection: {int(h.sum())} keys, {q.left} expected (input changed?)")
        cum = np.cumsum(h)
        b = int(np.searchsorted(cum, q.rank))          # the first bin reaching the rank
        before = int(cum[b - 1]) if b else 0
        nb = _next_bits(q.bits, hist_bits)
        q.prefix, q.bits = (q.prefix << nb) | b, q.bits + nb
        q.below, q.rank, q.left = q.below + before, q.rank - before, int(h[b])
        if q.bits == KEY_BITS:         # every candidate left has the same key
            q.key, q.at_or_below = q.prefix, q.below + q.left


def choose_rule(spark, ranges: list[tuple[int, int, int]], per_label: dict[int, int], seed: int,
                test_fraction: float, val_fraction: float, balance: bool, **rounds) -> tuple[SplitRule, dict, int]:
    """The :class:`SplitRule` of the stage's split and balancing (:mod:`pipeline.features.split`)
    for the events of ``ranges`` (``start, stop, label`` sample_id ranges; ``per_label``: events per
    label): (rule, {(split name, label): events}, bytes received from the tasks). ``rounds``:
    ``hist_bits``, ``values_limit`` of :func:`select`."""
    queries: dict = {}
    for lab, n in per_label.items():
        n_test, n_val = math.floor(n * test_fraction), math.floor(n * val_fraction)
        for name, k in (("test", n_test), ("val", n_test + n_val if n_val else 0)):
            if k:
                queries[(name, lab)] = Query("split", lab, None, k, n)
    received = select(spark, ranges, list(queries.values()), SplitRule(seed), **rounds) if queries else 0
    split_keys, counts = {}, {}
    for lab, n in per_label.items():
        q_test, q_val = queries.get(("test", lab)), queries.get(("val", lab))
        t_test, n_test = (q_test.key, q_test.at_or_below) if q_test else (-1, 0)
        t_val, n_tv = (q_val.key, q_val.at_or_below) if q_val else (t_test, n_test)
        split_keys[lab] = (t_test, t_val)
        counts[("test", lab)], counts[("val", lab)], counts[("train", lab)] = n_test, n_tv - n_test, n - n_tv
    rule = SplitRule(seed, split_keys)
    if not balance:
        return rule, counts, received
    bal = {}
    for s_i, s in enumerate(SPLITS):
        sizes = [counts[(s, lab)] for lab in per_label if counts[(s, lab)] > 0]
        m = min(sizes) if sizes else 0
        bal.update({(s_i, lab): Query("balance", lab, s_i, m, counts[(s, lab)])
                    for lab in per_label if counts[(s, lab)] > m})
    received += select(spark, ranges, list(bal.values()), rule, **rounds) if bal else 0
    for (s_i, lab), q in bal.items():
        counts[(SPLITS[s_i], lab)] = q.at_or_below
    return SplitRule(seed, split_keys, {k: q.key for k, q in bal.items()}), counts, received
