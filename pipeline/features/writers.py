"""Writing ``hlf/`` and ``llf/`` with pyarrow (never through Spark's row format): the writer task
of the second Spark pass, which applies the split rule to the work files' events and writes both
datasets, and the driver side that packs chunks into files and collects what the tasks wrote.

Each group of consecutive chunks becomes one ``llf/`` file; each task writes one ``hlf/`` file for
its consecutive groups (a new one when it reaches ``file_mb``). The files are written by the
task's attempt of the commit protocol (:mod:`pipeline.commit`: attempt-scoped names under the
job's prefix on the output's filesystem; a failed attempt's file is removed, a killed one's is
never committed). The tasks return the files they wrote, the rows per chunk and split, and the
moments of the train rows they wrote (the scaling fit), never the rows."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..commit import ATTEMPT_DDL, JobTarget, TaskAttempt, attempt_schema
from ..fs import Location
from ..packing import balanced_tasks, consecutive_groups
from ..spark import default_parallelism, spark_task, task_frame
from . import workfiles
from .layout import N_HLF, N_LLF_FEATURES
from .rows import HLF_ROW_BYTES, llf_row_bytes, output_schema, parquet_options, split_names
from .scaling import Moments, row_moments
from .split import SPLITS, SplitRule


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


def _row_bytes(table) -> np.ndarray:
    """Bytes of values of each row of an hlf/ or llf/ table."""
    if "n_particles" in table.column_names:
        return llf_row_bytes(table.column("n_particles").to_numpy())
    return np.full(table.num_rows, HLF_ROW_BYTES, np.int64)


class RowGroups:
    """Buffers rows for a ParquetWriter and writes row groups of at most ``budget`` bytes of
    values (:func:`row_group_cuts`; the last one of the file may be smaller): small tables from
    many chunks never make small row groups."""

    def __init__(self, writer, budget: int) -> None:
        self.writer, self.budget, self.pending, self.sizes, self.bytes = writer, budget, [], [], 0

    def add(self, table) -> None:
        self.pending.append(table)
        self.sizes.append(_row_bytes(table))
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


class PartFile:
    """One Parquet part of hlf/ or llf/ written by a task attempt through :class:`RowGroups`:
    :meth:`close` completes it, :meth:`abort` removes it."""

    def __init__(self, attempt: TaskAttempt, rel: str, with_llf: bool, budget: int) -> None:
        self.rel, self.schema = rel, output_schema(with_llf)
        self.part = attempt.parquet_writer(rel, self.schema, **parquet_options(self.schema))
        self.groups, self.rows, self.bytes = RowGroups(self.part.writer, budget), 0, 0

    def add(self, table) -> None:
        import pyarrow as pa

        table = pa.Table.from_arrays([table.column(n) for n in self.schema.names], schema=self.schema)
        self.bytes += int(_row_bytes(table).sum())
        self.rows += table.num_rows
        self.groups.add(table)

    def close(self) -> str:
        self.groups.close()
        self.part.close()
        return self.rel

    def abort(self, exc: BaseException) -> None:
        self.part.abort(exc)


def part_name(group: int) -> str:
    return f"part-{group:05d}.parquet"


#: the writer task's output: one row per chunk (``chunk`` >= 0: the rows of its work file and the
#: rows written per split), then one row per task (``chunk`` -1: the moments of the train rows
#: written); every row carries the commit protocol's attempt fields (the files written)
_WRITE_DDL = ("chunk int, rows long, written array<long>, hlf_n double, hlf_mean array<double>, "
              f"hlf_m2 array<double>, llf_n double, llf_mean array<double>, llf_m2 array<double>, {ATTEMPT_DDL}")


def _write_schema():
    import pyarrow as pa

    d = pa.list_(pa.float64())
    return attempt_schema(("chunk", pa.int32()), ("rows", pa.int64()), ("written", pa.list_(pa.int64())),
                          ("hlf_n", pa.float64()), ("hlf_mean", d), ("hlf_m2", d), ("llf_n", pa.float64()),
                          ("llf_mean", d), ("llf_m2", d))


def write_partition(batches: Iterator, *, target: JobTarget, rule: dict, llf_budget: int, hlf_budget: int,
                    file_bytes: int) -> Iterator:
    """The ``mapInArrow`` function of the second pass. Per group (``group, works, dirs, offsets,
    labels, chunks``: consecutive chunks, their work files and the attempts that wrote them, first
    sample_ids, labels): the work files' events, batch by batch, given ``sample_id``, ``label`` and
    their split by the :class:`~pipeline.features.split.SplitRule` (dropped where balancing drops
    them), written to ``llf/part-<group>`` and to this task's ``hlf/`` file."""
    import pyarrow as pa

    attempt = target.attempt()
    rule_ = SplitRule.from_json(rule)
    acc = [Moments.empty(N_HLF), Moments.empty(N_LLF_FEATURES)]
    hlf = llf = None
    schema = _write_schema()
    try:
        for batch in batches:
            d = batch.to_pydict()
            for gid, works, dirs, offsets, labels, chunks in zip(d["group"], d["works"], d["dirs"], d["offsets"],
                                                                 d["labels"], d["chunks"]):
                if hlf is not None and hlf.bytes >= file_bytes:
                    hlf.close()
                    hlf = None
                if hlf is None:
                    hlf = PartFile(attempt, f"hlf/{part_name(gid)}", False, hlf_budget)
                llf = PartFile(attempt, f"llf/{part_name(gid)}", True, llf_budget)
                for work, wdir, off, lab, cid in zip(works, dirs, offsets, labels, chunks):
                    rows, written = _copy_chunk(target.file(wdir, work), off, lab, rule_, llf, hlf, acc)
                    yield pa.RecordBatch.from_pylist([{"chunk": cid, "rows": rows, "written": written,
                                                       **attempt.record()}], schema=schema)
                llf.close()
                llf = None
        if hlf is not None:
            hlf.close()
            hlf = None
    except BaseException as e:
        for f in (hlf, llf):
            if f is not None:
                f.abort(e)
        raise
    h, l_ = acc
    yield pa.RecordBatch.from_pylist([{"chunk": -1, "hlf_n": h.n, "hlf_mean": h.mean.tolist(), "hlf_m2": h.m2.tolist(),
                                       "llf_n": l_.n, "llf_mean": l_.mean.tolist(), "llf_m2": l_.m2.tolist(),
                                       **attempt.record()}], schema=schema)


def _copy_chunk(work: Location, offset: int, label: int, rule: SplitRule, llf: PartFile, hlf: PartFile,
                acc: list) -> tuple[int, list[int]]:
    """One work file's events into the two part files: (rows read, rows written per split);
    the moments of the train rows are merged into ``acc``."""
    import pyarrow as pa

    pos, written = 0, np.zeros(len(SPLITS), np.int64)
    for b in workfiles.read_batches(work):
        t, m = pa.Table.from_batches([b]), b.num_rows
        codes = rule.codes(np.arange(offset + pos, offset + pos + m, dtype=np.int64), label)
        keep = np.flatnonzero(codes >= 0)
        if len(keep):
            t = t.take(pa.array(keep)) if len(keep) < m else t
            c = codes[keep]
            t = t.append_column("sample_id", pa.array(keep.astype(np.int64) + offset + pos, pa.int64())) \
                 .append_column("label", pa.array(np.full(len(keep), label, np.int64))) \
                 .append_column("split", split_names(c))
            llf.add(t)
            hlf.add(t)
            written += np.bincount(c, minlength=len(SPLITS))
            train = c == SPLITS.index("train")
            if train.any():
                h, l_ = row_moments(t.filter(pa.array(train)))
                acc[0], acc[1] = acc[0].merge(h), acc[1].merge(l_)
        pos += m
    return pos, written.tolist()


def llf_groups(chunks: list[tuple], file_mb: int, slots: int) -> list[list[int]]:
    """Consecutive chunks packed into LLF files of about ``file_mb`` at most, their number rounded
    up to a multiple of ``slots`` when there are that many chunks (so every task slot writes),
    each file closed once the next chunk would exceed an even share. ``chunks``: per chunk its
    expected llf/ bytes; returns the chunk indices of each file."""
    total = sum(chunks)
    n_files = max(1, math.ceil(total / (file_mb << 20)))
    if len(chunks) > n_files:   # a multiple of the task slots, so that no slot idles while another writes two
        n_files = min(len(chunks), math.ceil(n_files / max(1, slots)) * max(1, slots))
    return consecutive_groups(chunks, max(1, math.ceil(total / n_files)))


@dataclass
class Written:
    """What the writer tasks report: per chunk index (rows of its work file, rows written per
    split), the result rows (for :meth:`pipeline.commit.OutputJob.add`), the files written and the
    moments of the written train rows."""

    chunks: dict
    results: list
    files: list
    hlf: object
    llf: object
    received: int


def write_datasets(spark, target: JobTarget, groups: list[tuple], sizes: list[int], rule: SplitRule,
                   cfg) -> Written:
    """The second Spark pass: ``groups`` (group, work files, their attempt directories, first
    sample_ids, labels, chunk indices) packed into one task per task slot by their ``sizes``, each
    writing its llf/ files and one hlf/ file (:func:`write_partition`)."""
    fn = functools.partial(write_partition, target=target, rule=rule.to_json(),
                           llf_budget=max(1, int(cfg.llf_row_group_mb * (1 << 20))),
                           hlf_budget=max(1, int(cfg.hlf_row_group_mb * (1 << 20))), file_bytes=cfg.file_mb << 20)
    tasks = balanced_tasks(sizes, default_parallelism(spark))
    df = task_frame(spark, groups, "group int, works array<string>, dirs array<string>, offsets array<long>, "
                                   "labels array<long>, chunks array<int>", tasks)
    res = df.mapInArrow(spark_task(fn), _WRITE_DDL).toArrow()
    rows = res.to_pylist()
    out = Written({}, rows, [f for r in rows for f in r["files"] or []], Moments.empty(N_HLF),
                  Moments.empty(N_LLF_FEATURES), res.nbytes)
    for r in rows:
        if r["chunk"] >= 0:
            out.chunks[r["chunk"]] = (r["rows"], r["written"])
            continue
        out.hlf = out.hlf.merge(Moments(r["hlf_n"], np.asarray(r["hlf_mean"]), np.asarray(r["hlf_m2"])))
        out.llf = out.llf.merge(Moments(r["llf_n"], np.asarray(r["llf_mean"]), np.asarray(r["llf_m2"])))
    return out


def write_empty(job) -> None:
    """One empty file in hlf/ and in llf/ (nothing selected), so that readers still see the columns."""
    for name in ("hlf", "llf"):
        schema = output_schema(name == "llf")
        job.write_table(f"{name}/{part_name(0)}", schema.empty_table(), **parquet_options(schema))
