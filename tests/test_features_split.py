"""The feature stage's split and balancing decided on the driver: the numpy hash equals Spark's
``xxhash64`` expression the stage filters with, and the assignment has exact per-class counts."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.features.split import SPLITS, assign, hash_unit, spark_hash_unit


def test_numpy_hash_equals_spark_xxhash64(spark):
    from pyspark.sql import functions as F

    ids = np.concatenate([np.arange(300), [2 ** 40 + 3, 2 ** 62, -1, -(2 ** 50)]]).astype(np.int64)
    df = spark.createDataFrame([(int(i),) for i in ids], "sample_id long")
    cases = [(42, "split"), (7, "balance"), (2 ** 33 + 1, "split"), (-3, "balance"),
             (0, "a salt longer than thirty-two bytes, with é")]
    cols = [spark_hash_unit(F.col("sample_id"), seed, salt).alias(f"h{i}") for i, (seed, salt) in enumerate(cases)]
    rows = df.select("sample_id", *cols).orderBy("sample_id").collect()
    order = np.argsort(ids)
    for i, (seed, salt) in enumerate(cases):
        got = hash_unit(ids[order], seed, salt)
        want = np.array([r[f"h{i}"] for r in rows])
        assert np.array_equal(got, want), (seed, salt)
    u = hash_unit(np.arange(20000), 42, "split")
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_assignment_is_exact_stratified_and_balanced():
    rng = np.random.default_rng(1)
    labels = rng.choice([0, 1, 2], size=1000, p=[0.2, 0.5, 0.3])
    a = assign(labels, [0, 1, 2], seed=5, test_fraction=0.2, val_fraction=0.15, balance=False)
    u = hash_unit(np.arange(len(labels)), 5, "split")
    for lab in (0, 1, 2):
        mine = np.flatnonzero(labels == lab)
        n_test, n_val = math.floor(len(mine) * 0.2), math.floor(len(mine) * 0.15)
        by_u = mine[np.argsort(u[mine])]             # per class, ordered by the seeded hash
        assert (a.split[by_u[:n_test]] == SPLITS.index("test")).all()
        assert (a.split[by_u[n_test:n_test + n_val]] == SPLITS.index("val")).all()
        assert (a.split[by_u[n_test + n_val:]] == SPLITS.index("train")).all()
        assert a.counts[("test", lab)] == n_test and a.counts[("val", lab)] == n_val
    assert a.keep.all()
    assert (assign(labels, [0, 1, 2], 6, 0.2, 0.15, False).split != a.split).any()   # the seed matters
    b = assign(labels, [0, 1, 2], seed=5, test_fraction=0.2, val_fraction=0.15, balance=True)
    assert np.array_equal(b.split, a.split)
    v = hash_unit(np.arange(len(labels)), 5, "balance")
    for s_i, s in enumerate(SPLITS):
        kept = [int(((labels == lab) & (b.split == s_i) & b.keep).sum()) for lab in (0, 1, 2)]
        sizes = [int(((labels == lab) & (b.split == s_i)).sum()) for lab in (0, 1, 2)]
        assert kept == [min(sizes)] * 3 == [b.counts[(s, lab)] for lab in (0, 1, 2)]
        for lab in (0, 1, 2):                        # the kept ones have the smallest balance hash
            mine = (labels == lab) & (b.split == s_i)
            assert v[mine & b.keep].max(initial=-1) < v[mine & ~b.keep].min(initial=2)
    empty = assign(np.zeros(0, np.int64), [0, 1, 2], 1, 0.2, 0.1, True)
    assert len(empty.split) == 0 and all(c == 0 for c in empty.counts.values())


@pytest.mark.parametrize("rounds", [{}, {"hist_bits": 4, "values_limit": 32}])
def test_thresholds_from_the_tasks_histograms_give_the_reference_split(spark, rounds):
    """The split and balancing chosen from the tasks' histograms of the keys (a few rounds, or
    many narrow ones) give every event the split and the fate of the in-memory reference
    ``assign``, and the exact counts."""
    from pipeline.features.thresholds import choose_rule

    rng = np.random.default_rng(4)
    sizes = rng.integers(1, 900, 24)                 # chunks of one class each, classes interleaved
    chunk_labels = rng.choice([0, 1, 2], len(sizes), p=[0.5, 0.3, 0.2])
    labels = np.repeat(chunk_labels, sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ranges = [(int(a), int(a + n), int(lab)) for a, n, lab in zip(starts, sizes, chunk_labels)]
    per_label = {lab: int((labels == lab).sum()) for lab in (0, 1, 2)}
    ids = np.arange(len(labels))
    for balance in (False, True):
        want = assign(labels, [0, 1, 2], 9, 0.2, 0.1, balance)
        rule, counts, received = choose_rule(spark, ranges, per_label, 9, 0.2, 0.1, balance, **rounds)
        codes = np.concatenate([rule.codes(ids[a:b], lab) for a, b, lab in ranges])
        assert np.array_equal(codes, np.where(want.keep, want.split, -1))
        assert counts == want.counts
        assert 0 < received < 200_000
    # the seed matters
    other, _, _ = choose_rule(spark, ranges, per_label, 10, 0.2, 0.1, False, **rounds)
    assert not np.array_equal(np.concatenate([other.codes(ids[a:b], lab) for a, b, lab in ranges]),
                              np.concatenate([rule.codes(ids[a:b], lab) for a, b, lab in ranges]))
