"""The shard stage routes rows without reading every row's keys on the driver: what the driver
allocates (in Python and in pyarrow's memory pool) and what it receives from its tasks do not grow
with the rows, only with the files, row groups and destinations."""
from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from driver_memory import DriverMemory
from pipeline.shards.materialize import ShardConfig, shard


def _dataset(path, rows_per_group: int):
    """4 files of 2 row groups each, ``rows_per_group`` rows per row group, ids shuffled over files.
    Pages of 8 KiB, as the pages (1 MiB) of a real dataset are small against its row groups: what the
    driver reads of one row (a tensor column's length) is then one page, not a row group's column."""
    path.mkdir()
    n = 8 * rows_per_group
    rng = np.random.default_rng(rows_per_group)
    ids = rng.permutation(n).astype(np.int64)
    split = rng.choice(["train", "val", "test"], n, p=[0.7, 0.15, 0.15])
    hlf = rng.normal(size=(n, 14)).astype(np.float32)
    t = pa.table({"sample_id": ids, "label": rng.integers(0, 3, n), "split": split,
                  "hlf": pa.FixedSizeListArray.from_arrays(hlf.ravel(), 14).cast(pa.list_(pa.float32()))})
    for f in range(4):
        pq.write_table(t.slice(2 * f * rows_per_group, 2 * rows_per_group), path / f"part-{f}.parquet",
                       row_group_size=rows_per_group, data_page_size=8 << 10, use_dictionary=["split"])


def _run(spark, monkeypatch, src, out) -> tuple[int, int, int]:
    """(bytes of task results the driver took in, peak bytes the driver's Python allocated, peak
    bytes of pyarrow's memory pool above the start: Arrow buffers, which tracemalloc does not see)."""
    DataFrame = type(spark.range(1))
    got = {"bytes": 0}
    to_arrow, collect = DataFrame.toArrow, DataFrame.collect

    def counted_arrow(df):
        t = to_arrow(df)
        got["bytes"] += t.nbytes
        return t

    def counted_collect(df):
        rows = collect(df)
        got["bytes"] += len(pickle.dumps(rows))
        return rows

    monkeypatch.setattr(DataFrame, "toArrow", counted_arrow)
    monkeypatch.setattr(DataFrame, "collect", counted_collect)
    try:
        with DriverMemory() as mem:
            shard(ShardConfig(input=str(src), output=str(out), scheme="fine_grained", workers=4, copies=2,
                              row_group_rows=64), spark=spark)
    finally:
        monkeypatch.undo()
    return got["bytes"], mem.python, mem.arrow


def test_the_driver_does_not_grow_with_the_rows(spark, tmp_path, monkeypatch):
    # both above the fine-grained design's period (4,096 training rows): the design is the same size
    for size in (800, 4000):
        _dataset(tmp_path / f"in{size}", size)
    _run(spark, monkeypatch, tmp_path / "in800", tmp_path / "warm")        # imports and caches
    small = _run(spark, monkeypatch, tmp_path / "in800", tmp_path / "small")
    big = _run(spark, monkeypatch, tmp_path / "in4000", tmp_path / "big")
    got = pq.read_table(tmp_path / "big" / "worker_000").num_rows
    assert got > 10_000                                                # 32,000 rows, about 22,400 train x 2/4
    assert big[0] - small[0] < 512, (small, big)                       # results: per row group and directory
    assert big[1] - small[1] < 256 << 10, (small, big)                 # nothing of 5x the rows on the driver:
    assert big[2] - small[2] < 128 << 10, (small, big)                 # in Python or in Arrow buffers (64 KiB reads)
