"""Writing ``hlf/`` and ``llf/`` with pyarrow (never through Spark's row format): row groups of a
byte budget, the LLF writer task of the second Spark pass and the driver side that packs chunks
into files."""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from ..packing import consecutive_groups
from ..spark import spark_task, task_frame
from . import workfiles
from .plan import balanced_tasks
from .rows import (HLF_ROW_BYTES, fixed_lists, llf_row_bytes, output_schema, parquet_options, rows_per_group,
                   split_names)


def row_group_cuts(row_bytes: np.ndarray, budget: int, final: bool) -> list[int]:
    """Where to end row groups over rows of these sizes: each group as many rows as fit in
    ``budget`` bytes (at least one); the rows after the last cut wait for more unless ``final``."""
    cum = np.cumsum(row_bytes)
    cuts, start, base = [], 0, 0
    while start < len(cum):
        end = max(start + 1, int(np.searchsorted(cum, base + budget, side="right")))
        if end >= len(cum) and not final and cum[-1] - base < budget:
            break   # the group could still take rows
        end = min(end, len(cum))
        cuts.append(end)
        start, base = end, int(cum[end - 1])
    return cuts


class RowGroups:
    """Buffers LLF rows for a ParquetWriter and writes row groups of at most ``budget`` bytes of
    values (:func:`row_group_cuts`; the last one of the file may be smaller): small tables from
    many chunks never make small row groups."""

    def __init__(self, writer, budget: int) -> None:
        self.writer, self.budget, self.pending, self.sizes, self.bytes = writer, budget, [], [], 0

    def add(self, table) -> None:
        self.pending.append(table)
        self.sizes.append(llf_row_bytes(table.column("n_particles").to_numpy()))
        self.bytes += int(self.sizes[-1].sum())
        if self.bytes > self.budget:
            self._write(final=False)

    def close(self) -> None:
        if self.pending:
            self._write(final=True)

    def _write(self, final: bool) -> None:
        import pyarrow as pa

        t, sizes = pa.concat_tables(self.pending), np.concatenate(self.sizes)
        start = 0
        for end in row_group_cuts(sizes, self.budget, final):
            self.writer.write_table(t.slice(start, end - start), row_group_size=end - start)
            start = end
        rest = t.slice(start)
        self.pending, self.sizes = ([rest], [sizes[start:]]) if rest.num_rows else ([], [])
        self.bytes = int(sizes[start:].sum())


def llf_partition(batches: Iterator, *, work_dir: str, out_dir: str, row_group_bytes: int) -> Iterator:
    """One LLF file per group of consecutive chunks: each chunk's work file, batch by batch, its
    rows filtered and given ``sample_id`` (offset + position), ``label`` and ``split`` from the
    driver's assignment (``codes``: the split index per selected event, -1 where balancing drops
    it), written in row groups of at most ``row_group_bytes``."""
    import pyarrow as pa

    schema = output_schema(True)
    for batch in batches:
        d = batch.to_pydict()
        for gid, works, offsets, labels, codes in zip(d["group"], d["works"], d["offsets"], d["labels"],
                                                      d["codes"]):
            codes_all = np.frombuffer(codes, np.int8)
            name = os.path.join(out_dir, _llf_name(gid))
            # a hidden name (readers skip it) until complete, removed if this attempt fails
            tmp = os.path.join(out_dir, f".{_llf_name(gid)}.{os.getpid()}.tmp")
            try:
                rows = _write_group(tmp, schema, row_group_bytes, work_dir, works, offsets, labels, codes_all)
                os.replace(tmp, name)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            yield pa.RecordBatch.from_arrays([pa.array([gid], pa.int32()), pa.array([rows], pa.int64())],
                                             names=["group", "rows"])


def _llf_name(group: int) -> str:
    return f"part-{group:05d}.parquet"


def _write_group(path: str, schema, row_group_bytes: int, work_dir: str, works, offsets, labels, codes_all) -> int:
    """One LLF file from its chunks' work files (see :func:`llf_partition`); the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, at = 0, 0
    with pq.ParquetWriter(path, schema, **parquet_options(schema)) as writer:
        out = RowGroups(writer, row_group_bytes)
        for work, off, lab in zip(works, offsets, labels):
            pos = 0
            for t in workfiles.read_batches(os.path.join(work_dir, work)):
                m = t.num_rows
                c = codes_all[at + pos:at + pos + m]
                keep = np.flatnonzero(c >= 0)
                if len(keep):
                    t = t.take(pa.array(keep)) if len(keep) < m else t
                    out.add(pa.table({
                        "sample_id": pa.array(keep.astype(np.int64) + off + pos, pa.int64()),
                        "label": pa.array(np.full(len(keep), lab, np.int64)),
                        "split": split_names(c[keep]), "llf": t.column("llf"),
                        "n_particles": t.column("n_particles"), "hlf": t.column("hlf")}, schema=schema))
                    rows += len(keep)
                pos += m
            at += pos
        out.close()
    return rows


def write_hlf(path: Path, labels: np.ndarray, hlf: np.ndarray, codes: np.ndarray, file_mb: int,
              row_group_mb: float) -> None:
    """``hlf/`` on the driver from every selected event's label and HLF (sample_id order):
    ``file_mb`` files, row groups of ``row_group_mb``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    keep = np.flatnonzero(codes >= 0)
    schema = output_schema(False)
    table = pa.table({"sample_id": pa.array(keep.astype(np.int64)), "label": pa.array(labels[keep]),
                      "split": split_names(codes[keep]), "hlf": fixed_lists(hlf[keep].astype(np.float32))},
                     schema=schema)
    path.mkdir(parents=True, exist_ok=True)
    n_files = max(1, math.ceil(len(keep) * HLF_ROW_BYTES / (file_mb << 20)))
    per_file = max(1, math.ceil(len(keep) / n_files))
    rows = rows_per_group(row_group_mb, HLF_ROW_BYTES)
    for i in range(n_files):
        pq.write_table(table.slice(i * per_file, per_file), path / f"part-{i:05d}.parquet", row_group_size=rows,
                       **parquet_options(schema))


def llf_groups(chunks: list[tuple], file_mb: int, slots: int) -> list[tuple]:
    """Consecutive chunks packed into LLF files of about ``file_mb`` at most, their number rounded
    up to a multiple of ``slots`` when there are that many chunks (so every task slot writes),
    each file closed once the next chunk would exceed an even share. ``chunks``: (work file name,
    first sample_id, label, split codes of its events, llf bytes of its kept events) per chunk
    with selected events; returns task descriptors (group, work file names, sample_id offsets,
    labels, split codes)."""
    sizes = [c[4] for c in chunks]
    total = sum(sizes)
    n_files = max(1, math.ceil(total / (file_mb << 20)))
    if len(chunks) > n_files:   # a multiple of the task slots, so that no slot idles while another writes two
        n_files = min(len(chunks), math.ceil(n_files / max(1, slots)) * max(1, slots))
    target = max(1, math.ceil(total / n_files))
    out = []
    for g, idx in enumerate(consecutive_groups(sizes, target)):
        us = [chunks[i] for i in idx]
        out.append((g, [u[0] for u in us], [u[1] for u in us], [u[2] for u in us],
                    np.concatenate([u[3] for u in us]).tobytes()))
    return out


def write_llf(spark, path: Path, work_dir: Path, groups: list[tuple], row_group_mb: float) -> None:
    """``llf/``: each group becomes one Parquet file written with pyarrow (row groups of at most
    ``row_group_mb``) from its chunks' work files; the groups are packed into one Spark task
    per task slot. A file whose row count differs from the events the assignment keeps (a work
    file lost or cut short) fails the stage, naming the file."""
    path.mkdir(parents=True, exist_ok=True)
    if not groups:  # nothing selected: one empty file, so that readers still see the columns
        import pyarrow.parquet as pq

        schema = output_schema(True)
        pq.write_table(schema.empty_table(), path / "part-00000.parquet", **parquet_options(schema))
        return
    fn = functools.partial(llf_partition, work_dir=str(work_dir), out_dir=str(path),
                           row_group_bytes=max(1, int(row_group_mb * (1 << 20))))
    tasks = balanced_tasks([len(g[4]) for g in groups], spark.sparkContext.defaultParallelism)
    df = task_frame(spark, groups, "group int, works array<string>, offsets array<long>, labels array<long>, "
                                   "codes binary", tasks)
    written = {r["group"]: r["rows"] for r in df.mapInArrow(spark_task(fn), "group int, rows long").collect()}
    names = {_llf_name(g[0]) for g in groups}
    for p in path.iterdir():   # what a killed task attempt left (its hidden temporary file)
        if p.name not in names:
            p.unlink()
    for g in groups:
        want = int((np.frombuffer(g[4], np.int8) >= 0).sum())
        if written.get(g[0]) != want:
            raise RuntimeError(f"llf/part-{g[0]:05d}.parquet: {written.get(g[0])} rows written, the assignment "
                               f"keeps {want} (work files {g[1][0]} .. {g[1][-1]})")
