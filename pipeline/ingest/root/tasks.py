"""The Spark task bodies of ROOT ingestion: both passes read with uproot, convert to Arrow and
write their Parquet parts straight to the output's filesystem (:mod:`pipeline.commit`), returning
a small status row per file or chunk."""
from __future__ import annotations

import functools
import time
from typing import Iterator, Optional

from ...commit import JobTarget, TaskAttempt, attempt_fields
from .baskets import basket_maps
from .config import PARQUET_WRITE_OPTIONS
from .planning import CHUNK_COLUMNS
from .schema import as_schema, conform
from .trees import read_arrow, read_arrow_mapped
from .twopass import FilePlanning, read_range, scan_file

#: the status row of a chunk (second pass) and of a file (first pass), before the commit fields
STATUS_FIELDS = [("chunk_id", "int32"), ("file_index", "int32"), ("rows", "int64"), ("bytes", "int64"),
                 ("seconds", "float64"), ("part", "string"), ("error", "string")]
SCAN_FIELDS = [("file_index", "int32"), ("entries", "int64"), ("starts", "list<int64>"), ("stops", "list<int64>"),
               ("rows", "list<int64>"), ("parts", "list<string>"), ("done", "bool"), ("error", "string"),
               ("baskets", "list<binary>")]
_SPARK_TYPES = {"int32": "int", "int64": "long", "float64": "double", "string": "string", "bool": "boolean",
                "list<int64>": "array<long>", "list<string>": "array<string>", "list<binary>": "array<binary>"}


def result_schema(fields):
    """The pyarrow schema of a task's rows: ``fields`` and the commit fields."""
    import pyarrow as pa

    m = {"list<int64>": pa.list_(pa.int64()), "list<string>": pa.list_(pa.string()),
         "list<binary>": pa.list_(pa.binary())}
    return pa.schema([pa.field(n, m.get(t, t)) for n, t in fields] + attempt_fields())


def result_ddl(fields) -> str:
    """The same as Spark DDL."""
    return ", ".join([f"{n} {_SPARK_TYPES[t]}" for n, t in fields] + ["attempt_dir string", "files array<string>"])


def part_name(file_index: int, chunk_id: int) -> str:
    return f"part-f{file_index:05d}-c{chunk_id:05d}.parquet"


def convert_range(branches: list[str], schema):
    """``read`` of :mod:`.twopass` for ingestion: entries [a, b) as an Arrow table of ``schema``."""
    def read(t, a: int, b: int):
        return conform(read_arrow(t, branches, a, b), schema)
    return read


def _read_mapped(path: str, tree: str, branches: list[str], schema, baskets: bytes, scope: Optional[str], a: int,
                 b: int):
    return conform(read_arrow_mapped(path, tree, branches, a, b, baskets, scope), schema)


def write_part(attempt: TaskAttempt, table, part: str, row_group_rows: Optional[int]) -> tuple[int, int]:
    """``table`` as the part ``part`` of this attempt; (rows, bytes). No file for 0 rows."""
    if table is None or table.num_rows == 0:
        return 0, 0
    return table.num_rows, attempt.write_table(part, table, row_group_size=row_group_rows, **PARQUET_WRITE_OPTIONS)


def scan_partition(batches: Iterator, *, planning: FilePlanning, schema, target: JobTarget,
                   row_group_rows: Optional[int]) -> Iterator:
    """First pass, one task per file (``file_index``, ``path``): plan it; a file that is a single
    chunk is converted right here and its part written; larger files return their ranges, each
    with its basket map (:func:`~.baskets.basket_maps`)."""
    import pyarrow as pa

    schema = as_schema(schema)
    attempt = target.attempt()
    read = convert_range(planning.branches, schema)
    out_schema = result_schema(SCAN_FIELDS)

    def describe(t, ranges):
        return basket_maps(t, planning.branches, ranges)

    for batch in batches:
        d = batch.to_pydict()
        for fi, path in zip(d["file_index"], d["path"]):
            s = scan_file(path, planning, read, describe)
            r = {"file_index": fi, "entries": s.entries, "starts": [x for x, _ in s.ranges],
                 "stops": [y for _, y in s.ranges], "rows": [], "parts": [], "done": s.done, "error": s.error,
                 "baskets": s.notes}
            if s.done and s.ranges and not s.error:
                part = part_name(fi, 0)
                n, _ = write_part(attempt, s.data, part, row_group_rows)
                r["rows"], r["parts"] = [n], [part if n else None]
            yield pa.RecordBatch.from_pylist([{**r, **attempt.record()}], schema=out_schema)


def ingest_partition(batches: Iterator, *, branches: list[str], schema, target: JobTarget,
                     row_group_rows: Optional[int], timeout_s: Optional[float]) -> Iterator:
    """Second pass, one task per chunk of a multi-chunk file: read it (at most ``timeout_s``;
    with its basket map, without opening the file's tree when every branch is in the map), write
    its part, yield a status row."""
    import pyarrow as pa

    schema = as_schema(schema)
    attempt = target.attempt()
    read = convert_range(branches, schema)
    out_schema = result_schema(STATUS_FIELDS)
    for batch in batches:
        d = batch.to_pydict()
        for cid, fi, path, tree, a, b, baskets in zip(*(d[c] for c in CHUNK_COLUMNS)):
            t0 = time.time()
            part = part_name(fi, cid)
            read_at = None if baskets is None else functools.partial(
                _read_mapped, path, tree, branches, schema, baskets, target.staging)
            table, err = read_range(path, tree, a, b, read, timeout_s, scope=target.staging, read_at=read_at)
            n, nbytes = write_part(attempt, table, part, row_group_rows)
            yield pa.RecordBatch.from_pylist([{"chunk_id": cid, "file_index": fi, "rows": n, "bytes": nbytes,
                                               "seconds": time.time() - t0, "part": part if n else None,
                                               "error": err, **attempt.record()}], schema=out_schema)
