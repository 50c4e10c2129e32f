"""Routing the input's rows to their destinations, in the tasks: each task reads its row groups
through ``pyarrow.fs`` (local or ``s3://``), gives every training row its position (the row
group's offset from the driver's counts plus the row's index among its training rows) and the
destinations the :class:`~pipeline.shards.schemes.Router` computes from it, and every evaluation
row its split's directory; a row held by C workers becomes C rows. Spark then brings every
destination's rows to one writer task (:mod:`pipeline.shards.write`)."""
from __future__ import annotations

import functools
from typing import Iterator

import numpy as np

from ..fs import location
from ..packing import balanced_tasks
from ..spark import default_parallelism, spark_task, task_frame
from .scan import RESERVED, Scan
from .schemes import Router

TRAIN_SPLIT = "train"
DEST, PKEY, ORDER = RESERVED
#: Spark has no unsigned integers or half floats: their columns travel widened and are cast back by
#: the writer (the shards keep the input's exact types)
_WIDER = {"uint8": "int16", "uint16": "int32", "uint32": "int64", "halffloat": "float"}


def spark_type(t):
    """An Arrow type Spark can carry for ``t`` (unsigned integers and half floats widened)."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(spark_type(t.value_type))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(spark_type(t.value_type))
    if pa.types.is_uint64(t):
        return pa.decimal128(20, 0)
    return pa.type_for_alias(_WIDER[str(t)]) if str(t) in _WIDER else t


def routed_schema(schema):
    """The Arrow schema of the routed rows: the input's columns in Spark's types, then the
    destination, its partition key and the row's order in it."""
    import pyarrow as pa

    fields = [pa.field(f.name, spark_type(f.type)) for f in schema]
    return pa.schema(fields + [pa.field(DEST, pa.int32()), pa.field(PKEY, pa.int64()), pa.field(ORDER, pa.int64())])


def route_partition(batches: Iterator, *, router: Router, eval_names: list[str], pkeys: list[int], schema_bytes: bytes,
                    batch_rows: int) -> Iterator:
    """The ``mapInArrow`` function: per row group (``uri, row_group, train_offset, eval_offsets``),
    its rows with their destinations (:func:`routed_schema`), in batches of ``batch_rows``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    columns = pa.schema(list(out_schema)[:-len(RESERVED)])         # the input's, in the first file's order
    for batch in batches:
        d = batch.to_pydict()
        for uri, g, t_off, e_off in zip(d["uri"], d["row_group"], d["train_offset"], d["eval_offsets"]):
            loc = location(uri)
            with loc.filesystem().open_input_file(loc.path) as f:
                t = pq.ParquetFile(f).read_row_group(g)
            idx, dest, order = _destinations(t, router, eval_names, t_off, e_off)
            routed = t.select(columns.names).take(pa.array(idx)).cast(columns)
            routed = (routed.append_column(DEST, pa.array(dest, pa.int32()))
                      .append_column(PKEY, pa.array(np.asarray(pkeys, np.int64)[dest], pa.int64()))
                      .append_column(ORDER, pa.array(order, pa.int64())))
            yield from routed.to_batches(max_chunksize=batch_rows)


def _destinations(t, router: Router, eval_names: list[str], train_offset: int, eval_offsets: list[int]):
    """(row index, destination, order) of every routed row of a table: each training row once per
    worker holding it, each evaluation row once."""
    import pyarrow.compute as pc

    split = np.asarray(pc.cast(t.column("split"), "string").to_numpy(zero_copy_only=False), dtype=object)
    M = router.layout.workers
    train = np.flatnonzero(split == TRAIN_SPLIT)
    pos = train_offset + np.arange(len(train), dtype=np.int64)
    held = router.workers(pos)                          # (k, C)
    idx, dest = np.repeat(train, held.shape[1]), held.ravel().astype(np.int64)
    order = np.empty(len(idx), np.int64)
    pos_rep = np.repeat(pos, held.shape[1])
    for w in np.unique(dest):
        m = dest == w
        order[m] = router.order(pos_rep[m], int(w))
    parts = [(idx, dest, order)]
    for j, (name, off) in enumerate(zip(eval_names, eval_offsets)):
        rows = np.flatnonzero(split == name)
        parts.append((rows, np.full(len(rows), M + j, np.int64), off + np.arange(len(rows), dtype=np.int64)))
    return tuple(np.concatenate(x) for x in zip(*parts))


def routed_frame(spark, sc: Scan, router: Router, eval_names: list[str], pkeys: list[int], batch_rows: int):
    """A DataFrame of the routed rows, read and routed in the tasks: one task per group of
    consecutive row groups of about equal bytes, as many as the task slots (at least)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    units, train_at, eval_at = [], 0, {s: 0 for s in eval_names}
    for fi, g, _rows, _bytes, counts in sc.groups:
        units.append((sc.files[fi], g, train_at, [eval_at[s] for s in eval_names]))
        train_at += counts.get(TRAIN_SPLIT, 0)
        for s in eval_names:
            eval_at[s] += counts.get(s, 0)
    out_schema = routed_schema(sc.schema)
    fn = functools.partial(route_partition, router=router, eval_names=eval_names, pkeys=pkeys,
                           schema_bytes=out_schema.serialize().to_pybytes(), batch_rows=batch_rows)
    tasks = balanced_tasks([max(1, g[3]) for g in sc.groups], max(default_parallelism(spark),
                                                                  len(sc.groups) // 8 or 1))
    df = task_frame(spark, units, "uri string, row_group int, train_offset long, eval_offsets array<long>", tasks)
    return df.mapInArrow(spark_task(fn), from_arrow_schema(pa.schema([f.remove_metadata() for f in out_schema])))
