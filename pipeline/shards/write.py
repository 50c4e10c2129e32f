"""The shard stage's writer task: the routed rows of one partition (sorted by destination, then by
their order in it) become one Parquet file per destination, in row groups of exactly
``row_group_rows`` rows (the last one smaller), the input's columns and types, the tensor columns
as one fixed-size binary tensor per row (:mod:`pipeline.shards.tensors`). Files are written by
the task's attempt of the commit protocol (:mod:`pipeline.commit`): attempt-scoped names under the
job's prefix on the output's filesystem; the driver commits the attempts Spark returned."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ..commit import ATTEMPT_DDL, JobTarget, TaskAttempt, attempt_schema
from ..schemas import pad_length
from .tensors import encode, tensor_field

WRITE_DDL = f"dest int, file string, rows long, row_groups int, error string, {ATTEMPT_DDL}"


def output_schema(schema, tensors: dict[str, tuple[str, int]]):
    """The shards' Arrow schema: the input's, with each tensor column as fixed-size binary."""
    import pyarrow as pa

    return pa.schema([tensor_field(f.name, *tensors[f.name]) if f.name in tensors else f for f in schema],
                     metadata=schema.metadata)


def writer_options(out_schema, tensors) -> dict:
    """ParquetWriter options: snappy; no dictionary or statistics for the tensor columns (every
    value is distinct, and min/max of a tensor's bytes are meaningless)."""
    plain = [f.name for f in out_schema if f.name not in tensors]
    return {"compression": "snappy", "use_dictionary": plain, "write_statistics": plain}


def _as_tensors(table, tensors: dict[str, tuple[str, int]], out_schema, padded: frozenset = frozenset()):
    """Encode the tensor columns of ``table`` (those in ``padded`` padded with zeros); ValueError
    naming the column on a bad row."""
    import pyarrow as pa

    cols = [encode(table.column(f.name), f.name, *tensors[f.name], pad=f.name in padded) if f.name in tensors
            else table.column(f.name) for f in out_schema]
    return pa.Table.from_arrays(cols, schema=out_schema)


class _DestFile:
    """One destination's file: rows buffered into row groups of exactly ``rows_per_group``."""

    def __init__(self, attempt: TaskAttempt, rel: str, out_schema, options: dict, rows_per_group: int) -> None:
        self.rel, self.rows_per_group = rel, rows_per_group
        self.part = attempt.parquet_writer(rel, out_schema, **options)
        self.pending, self.n, self.rows, self.groups = [], 0, 0, 0

    def put(self, table, final: bool = False) -> None:
        """Buffer rows; write every complete row group (and the rest when final)."""
        import pyarrow as pa

        if table is not None and table.num_rows:
            self.pending.append(table)
            self.n += table.num_rows
        if self.n == 0 or (self.n < self.rows_per_group and not final):
            return
        t = pa.concat_tables(self.pending)
        full = self.n if final else (self.n // self.rows_per_group) * self.rows_per_group
        self.part.writer.write_table(t.slice(0, full), row_group_size=self.rows_per_group)
        self.groups += -(-full // self.rows_per_group)
        self.rows += full
        rest = t.slice(full)
        self.pending, self.n = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> None:
        self.put(None, final=True)
        self.part.close()

    def abort(self, exc: BaseException) -> None:
        self.part.abort(exc)


def write_partition(batches: Iterator, *, target: JobTarget, dirs: list[str], schema_bytes: bytes,
                    row_group_rows: int, tensors: dict[str, tuple[str, int]]) -> Iterator:
    """The ``mapInArrow`` function: Arrow batches (input columns + destination, sorted by
    destination) -> one Parquet file per destination of this partition. A row that breaks a
    tensor column stops the task and is reported in the result's ``error``."""
    import pyarrow as pa

    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    columns = list(schema.names)
    out_schema = output_schema(schema, tensors)
    options = writer_options(out_schema, tensors)
    padded = frozenset(f.name for f in schema if f.name in tensors and pad_length(f) is not None)
    attempt = target.attempt()
    name = f"part-{attempt.partition:05d}.parquet"
    result = attempt_schema(("dest", pa.int32()), ("file", pa.string()), ("rows", pa.int64()),
                            ("row_groups", pa.int32()), ("error", pa.string()))
    done, cur, dest_of = [], None, None
    try:
        for b in batches:
            if b.num_rows == 0:
                continue
            dest = b.column(len(columns)).to_numpy()
            try:
                table = _as_tensors(pa.Table.from_batches([b]).select(columns).cast(schema), tensors, out_schema,
                                    padded)
            except ValueError as e:
                done.append({"dest": -1, "file": "", "rows": 0, "row_groups": 0, "error": str(e)})
                break
            cuts = np.flatnonzero(np.diff(dest)) + 1       # rows arrive sorted by dest
            for s, e in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(dest)]])):
                d = int(dest[s])
                if dest_of != d:
                    if cur is not None:
                        cur.close()
                        done.append({"dest": dest_of, "file": name, "rows": cur.rows, "row_groups": cur.groups,
                                     "error": None})
                    cur, dest_of = _DestFile(attempt, f"{dirs[d]}/{name}", out_schema, options, row_group_rows), d
                cur.put(table.slice(s, e - s))
        if cur is not None:
            cur.close()
            done.append({"dest": dest_of, "file": name, "rows": cur.rows, "row_groups": cur.groups, "error": None})
            cur = None
    except BaseException as e:
        if cur is not None:
            cur.abort(e)
        raise
    rec = attempt.record()
    yield pa.RecordBatch.from_pylist([{**r, **rec} for r in done] or [{"dest": -2, **rec}], schema=result)
