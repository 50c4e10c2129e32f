"""The shard stage's first look at its input, without reading every row's keys on the driver: the
dataset's files (committed, local or ``s3://``: :mod:`pipeline.inputs`), their schema, and one
Spark pass whose tasks count the rows of each split per row group and check the key columns (no
nulls, unique ``sample_id``, split names usable as directory names). The driver gets per row
group counts and per file id ranges: the offsets that give every training row its position."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import BadInputError
from ..fs import location
from ..inputs import dataset_files, parquet_frame, parquet_schema_of
from ..spark import default_parallelism, forward_s3_settings, spark_task, task_frame

KEYS = ("sample_id", "split")
#: columns the stage adds to the rows it routes (an input may not have them)
RESERVED = ("__shard_dest", "__shard_pkey", "__shard_order")
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
_COUNT_DDL = ("file_index int, row_group int, rows long, bytes long, splits string, min_id long, max_id long, "
              "duplicate long, error string")


@dataclass
class Scan:
    """The input as the stage sees it: its files (URIs), schema, and per row group (file index,
    row group, rows, uncompressed bytes, {split: rows}) in file order."""

    files: list[str]
    schema: object
    groups: list[tuple]

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for *_, counts in self.groups:
            for s, n in counts.items():
                out[s] = out.get(s, 0) + n
        return out

    def bytes_per_row(self) -> float:
        rows = sum(g[2] for g in self.groups)
        return sum(g[3] for g in self.groups) / rows if rows else 1024.0


def check_schema(schema, where: str) -> None:
    """The key columns exist with usable types and no reserved name is taken; BadInputError otherwise."""
    import pyarrow as pa

    for col, ok, want in (("sample_id", pa.types.is_integer, "an integer type"),
                          ("split", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "string")):
        idx = schema.get_field_index(col)
        if idx < 0:
            raise BadInputError(f"{where}: missing column {col!r} (the shard stage needs sample_id and split)")
        t = schema.field(idx).type
        if not ok(t):
            raise BadInputError(f"{where}: column {col!r} has type {t}, expected {want}")
    for reserved in RESERVED:
        if reserved in schema.names:
            raise BadInputError(f"{where}: column {reserved!r} is reserved by the shard stage")


def count_partition(batches: Iterator, *, schema_bytes: bytes) -> Iterator:
    """The ``mapInArrow`` function: per file (``file_index, uri``), per row group, the rows of each
    split and the checks of the keys; a file that cannot be read or whose schema differs from the
    first file's (:func:`schema_difference`) is one ``error``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    want = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    for batch in batches:
        d = batch.to_pydict()
        for fi, uri in zip(d["file_index"], d["uri"]):
            rows = []
            try:
                loc = location(uri)
                with loc.filesystem().open_input_file(loc.path) as f:
                    pf = pq.ParquetFile(f)
                    diff = schema_difference(pf.schema_arrow, want)
                    if diff:
                        raise ValueError(diff)
                    seen = []
                    for g in range(pf.metadata.num_row_groups):
                        t = pf.read_row_group(g, columns=list(KEYS))
                        rows.append(_count(fi, g, t, pf.metadata.row_group(g).total_byte_size))
                        seen.append(t.column("sample_id").to_numpy())
                    ids = np.concatenate(seen) if seen else np.zeros(0, np.int64)
                    uniq, counts = np.unique(ids, return_counts=True)
                    if (counts > 1).any() and rows:
                        rows[0]["duplicate"] = int(uniq[counts > 1][0])
            except Exception as e:  # noqa: BLE001 - one line naming the file
                rows = [{"file_index": fi, "row_group": -1, "error": " ".join(str(e).split())[:300]}]
            yield pa.RecordBatch.from_pylist(rows, schema=_count_schema())


def schema_difference(got, want) -> str:
    """'' when ``got`` has the columns and types of ``want`` (the first file's schema), else what
    differs first, naming the column."""
    for f in want:
        i = got.get_field_index(f.name)
        if i < 0:
            return f"no column {f.name!r} (the first file of the dataset has it)"
        if not got.field(i).type.equals(f.type):
            return f"column {f.name!r} has type {got.field(i).type}, the first file's has {f.type}"
    extra = [n for n in got.names if want.get_field_index(n) < 0]
    return f"column {extra[0]!r} is not in the first file of the dataset" if extra else ""


def _count(fi: int, g: int, t, nbytes: int) -> dict:
    import pyarrow.compute as pc

    ids, split = t.column("sample_id"), t.column("split")
    nulls = {c: t.column(c).null_count for c in KEYS if t.column(c).null_count}
    counts = pc.value_counts(split.combine_chunks()).to_pylist() if t.num_rows else []
    row = {"file_index": fi, "row_group": g, "rows": t.num_rows, "bytes": int(nbytes),
           "splits": json.dumps({c["values"]: c["counts"] for c in counts if c["values"] is not None}),
           "min_id": pc.min(ids).as_py(), "max_id": pc.max(ids).as_py()}
    if nulls:
        col, n = next(iter(nulls.items()))
        row["error"] = f"column {col!r} has {n} null value(s)"
    return row


def _count_schema():
    import pyarrow as pa

    return pa.schema([("file_index", pa.int32()), ("row_group", pa.int32()), ("rows", pa.int64()),
                      ("bytes", pa.int64()), ("splits", pa.string()), ("min_id", pa.int64()), ("max_id", pa.int64()),
                      ("duplicate", pa.int64()), ("error", pa.string())])


def scan(spark, path, version=None) -> tuple[Scan, int]:
    """The input's files (a Delta table: its snapshot at ``version``), schema and per row group
    counts (one Spark pass); BadInputError naming the file and column of the first problem.
    Returns (scan, bytes received from the tasks)."""
    files = dataset_files(path, version=version)
    if not location(path).is_local:
        forward_s3_settings(spark)
    schema = parquet_schema_of(files[0])
    check_schema(schema, str(location(path)))
    slots = default_parallelism(spark)
    fn = functools.partial(count_partition, schema_bytes=schema.remove_metadata().serialize().to_pybytes())
    df = task_frame(spark, [(i, u) for i, u in enumerate(files)], "file_index int, uri string",
                    tasks=[i * slots * 4 // len(files) for i in range(len(files))])
    res = df.mapInArrow(spark_task(fn), _COUNT_DDL).toArrow()
    rows = sorted(res.to_pylist(), key=lambda r: (r["file_index"], r["row_group"]))
    for r in rows:
        if r["error"]:
            raise BadInputError(f"{files[r['file_index']]}: {r['error']}")
        if r["duplicate"] is not None:
            raise BadInputError(f"{location(path)}: column 'sample_id' has duplicate value {r['duplicate']}")
    groups = [(r["file_index"], r["row_group"], r["rows"], r["bytes"], json.loads(r["splits"] or "{}")) for r in rows]
    for name in {s for g in groups for s in g[4]}:
        if not _SPLIT_NAME.match(name):
            raise BadInputError(f"{location(path)}: column 'split' has value {name!r}, not usable as a directory name")
    _check_unique_across_files(spark, path, files, rows, version)
    return Scan(files, schema, groups), res.nbytes


def _check_unique_across_files(spark, path, files: list[str], rows: list[dict], version=None) -> None:
    """Ids are unique within each file (checked by its task); across files they can only collide
    where the files' id ranges overlap, and then a Spark aggregation finds the first duplicate."""
    spans: dict[int, list[int]] = {}
    for r in rows:
        if r["min_id"] is None:
            continue
        lo, hi = spans.get(r["file_index"], [r["min_id"], r["max_id"]])
        spans[r["file_index"]] = [min(lo, r["min_id"]), max(hi, r["max_id"])]
    ordered = sorted(spans.values())
    if all(a[1] < b[0] for a, b in zip(ordered, ordered[1:])):
        return
    from pyspark.sql import functions as F

    dup = (parquet_frame(spark, path, columns=["sample_id"], version=version).groupBy("sample_id").count()
           .where(F.col("count") > 1).limit(1).collect())
    if dup:
        raise BadInputError(f"{location(path)}: column 'sample_id' has duplicate value {dup[0]['sample_id']}")
