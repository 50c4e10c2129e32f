"""The feature stage on Spark (``jobs/features.py``): Delphes events -> ``hlf/``, ``llf/``, ``scaling.json``.

Input, either of:

* an ingested dataset (``jobs/ingest_root.py`` output, recognised by its ``_report.json``): each
  Parquet part is one work unit, and the report says which ROOT file and entry range it holds,
  which is what the labels and the per-file counts need; or
* ROOT files (paths/globs, or no ``input`` at all: the files of ``samples``), cut into
  entry-range chunks exactly as the ingestion does (``step_size``) and read with uproot in the
  tasks. The driver never opens them: like the ingestion, the tasks plan the files.

Flow: one Spark pass computes the features, the driver decides the rest from the tasks'
statuses, a second Spark pass writes the LLF (two Spark jobs in all, three when a ROOT file is
larger than one chunk; every Parquet file is written with pyarrow, never through Spark's row
format):

1. the feature pass (``mapInArrow``; consecutive work units packed into tasks of about
   :data:`TASK_ENTRIES` entries): a ROOT file is opened in its task, which cuts its entry
   ranges; a file of one chunk (the usual case) is processed right there, on the same open
   tree, and the chunks of a larger file go to a second pass of the same function (one Spark
   job more). Per chunk the task reads the :data:`~pipeline.features.delphes.REQUIRED_BRANCHES`,
   runs :func:`~pipeline.features.delphes.compute_features`, leaves the selected events (llf of
   the real particles, n_particles, hlf) in an Arrow IPC work file in the staging directory, and
   returns one status row: events read, selected, or the error, plus the chunk's HLF and
   per-event partial moments of the LLF (count, mean, M2 of each feature over the real
   particles);
2. on the driver, from the statuses alone: files with a failed chunk are dropped and reported;
   ``sample_id`` = dense index over the selected events in (file, entry) order, so each file holds
   one contiguous id range (kept in ``report.json``); the split and the optional balancing of
   every event (:mod:`pipeline.features.split`: per class, events ordered by a seeded hash of
   their sample_id, exact counts); the per-file and per-split counts; the scaling statistics of
   the train events, merged from the partial moments (:mod:`pipeline.features.scaling`);
   ``hlf/`` is written here, from the statuses' HLF;
3. ``llf/``: consecutive chunks are packed into files of at most ``file_mb`` (at least one file
   per task slot when there are enough chunks); one Spark task per file reads its chunks' work
   files, keeps the events the assignment keeps, adds sample_id, label and split, and writes
   row groups of at most ``llf_row_group_mb`` (readers hold one row group at a time). The work
   files are removed; the schemas are checked from the Parquet footers against ``schemas/hlf``
   and ``schemas/llf`` (the values come from numpy blocks of fixed width, or of ``19 x
   n_particles`` for the LLF, so no column can be null or of another length).

``llf/`` stores each event's real particles only (schema v3: ``19 x n_particles`` floats, at
most 801 particles); readers pad to 801 x 19 with zero rows (``pad_to`` in the schema and in the
Parquet field metadata; the shard stage writes the padded tensors the models read). The padded
layout made the LLF write cost more than the features themselves (docs/hep-features.md).

The work files live in the output's staging directory, which every executor reaches (it writes
the output there): a shared filesystem on a cluster, the driver's disk for an ``s3://`` output
(local Spark master only, see :func:`pipeline.outputs.check_staging`).

Bad files (unreadable, no tree, missing branch, no sample label, a chunk failing) are listed
in ``report.json`` and logged one line each; the good files are written; then the stage raises
BadInputError unless ``allow_bad_files``.
"""
from __future__ import annotations

import fnmatch
import functools
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import StageConfig
from ..packing import consecutive_groups
from ..errors import BadInputError, ConfigError
from ..spark import spark_task, task_frame
from ..ingest.root import (FILE_TIMEOUT_S, SAMPLES_PREFIX, Chunk, FileInfo, ReadTimeout, first_line,
                           parse_step_size, resolve_files)
from . import delphes as D
from .layout import CLASS_LABELS, HLF_NAMES, LLF_NAMES, LLF_SIZE, N_CLASSES, N_HLF, N_LLF_FEATURES, N_PARTICLES
from .split import SPLITS, Assignment, assign

log = logging.getLogger(__name__)
#: the versions of schemas/hlf and schemas/llf the stage writes
SCHEMA_VERSIONS = {"hlf": 2, "llf": 3}

class SampleSpec(BaseModel):
    """One physics sample: a label and the files (paths/globs) that belong to it."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., description="sample name (free text, e.g. ttbar)")
    label: int = Field(..., ge=0, le=N_CLASSES - 1, description="class label: QCD=0, ttbar=1, W+jets=2 (or the class name)")
    files: list[str] = Field(..., min_length=1, description="paths/globs of this sample's ROOT files")

    @field_validator("label", mode="before")
    @classmethod
    def _label(cls, v):
        if isinstance(v, str) and not v.strip().isdigit():
            key = v.strip().lower()
            if key not in CLASS_LABELS:
                raise ValueError(f"unknown class {v!r} (use 0/1/2 or qcd/ttbar/wjets)")
            return CLASS_LABELS[key]
        return v


class FeaturesConfig(StageConfig):
    """Settings of ``jobs/features.py``."""

    input: Optional[Union[str, list[str]]] = Field(
        None, description="ingested dataset dir(s) (ingest_root output) or ROOT paths/globs; "
                          "default: the files of samples")
    samples: list[SampleSpec] = Field(..., min_length=1, description="label of each file: the first sample "
                                      "with a matching path/glob (QCD=0, ttbar=1, W+jets=2)")
    tree: str = Field("Delphes", description="TTree or RNTuple name when reading ROOT files")
    output: str = Field("runs/hep/features", description="output dir: hlf/, llf/, scaling.json, report.json")
    step_size: Union[int, str] = Field("50 MB", description="ROOT chunk size (entries or '50 MB'); one task each")
    test_fraction: float = Field(0.2, ge=0, lt=1, description="fraction of each class in the test split")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="fraction of each class in the val split")
    seed: int = Field(42, description="seed of the split and of the class balancing")
    balance_classes: bool = Field(False, description="undersample every split to its smallest non-empty class")
    allow_bad_files: bool = Field(False, description="exit 0 even if some files could not be used")
    hlf_row_group_mb: float = Field(8, gt=0, description="Parquet row group size of hlf/ [MiB]")
    llf_row_group_mb: float = Field(32, gt=0, description="Parquet row group size of llf/ [MiB]")
    file_mb: int = Field(256, gt=0, description="target Parquet file size [MiB] (sets the number of files)")
    schema_dir: Optional[str] = Field(None, description="schemas folder (default: the repository's schemas/)")
    file_timeout_s: float = Field(FILE_TIMEOUT_S, gt=0, description="seconds allowed to open one ROOT file and "
                                  "to read one chunk; longer: the file is reported as bad")
    work_compression: Literal["none", "lz4", "zstd"] = Field(
        "lz4", description="compression of the work files between the two Spark passes (Arrow IPC in the "
                           "output's staging directory, removed at the end): lz4 stages about 0.6x the bytes "
                           "of none, which saves about 6 CPU-microseconds per event where the staging disk "
                           "keeps up (tmpfs, fast local disks)")

    @field_validator("step_size")
    @classmethod
    def _step(cls, v):
        parse_step_size(v)
        return v

    @model_validator(mode="after")
    def _fractions(self):
        if self.test_fraction + self.val_fraction >= 1:
            raise ValueError(f"test_fraction + val_fraction = {self.test_fraction + self.val_fraction} must be < 1")
        return self


# --------------------------------------------------------------------------------------------
# inputs and labels
# --------------------------------------------------------------------------------------------

def _expand_pattern(p: str) -> str:
    if p.startswith(SAMPLES_PREFIX):
        from ..samples import coffea_samples
        return str(coffea_samples() / p[len(SAMPLES_PREFIX):])
    if "://" in p:
        return p
    p = os.path.expandvars(os.path.expanduser(p))
    return os.path.abspath(p) if (os.sep in p or os.path.exists(p)) and not p.startswith("*") else p


def label_of(path: str, samples: list[SampleSpec]) -> Optional[int]:
    """The label of the first sample with a pattern matching ``path`` (full path or file name)."""
    base = os.path.basename(path)
    for s in samples:
        for pat in s.files:
            pe = _expand_pattern(pat)
            if path == pe or fnmatch.fnmatch(path, pe) or fnmatch.fnmatch(base, pe):
                return s.label
    return None


def _is_ingested(p: str) -> bool:
    return os.path.isdir(os.path.expanduser(p)) and os.path.isfile(os.path.join(os.path.expanduser(p), "_report.json"))


#: ``entry_start`` of a work unit that is a whole ROOT file, planned by its task
WHOLE_FILE = -1


def plan_units(cfg: FeaturesConfig) -> tuple[list[FileInfo], list[Chunk], dict[int, int], list[str]]:
    """(source files, work units, file_index -> label, notes), without opening a ROOT file: a
    ROOT file is one unit with ``entry_start == entry_stop ==`` :data:`WHOLE_FILE` (its task cuts
    it); an ingested dataset's parts are units with their entry ranges. Files without a sample
    label carry ``error`` and have no unit."""
    from ..outputs import read_json

    required = list(D.REQUIRED_BRANCHES)
    files: list[FileInfo] = []
    units: list[Chunk] = []
    notes: list[str] = []
    if cfg.input is None:
        raw: list[str] = []
        for s in cfg.samples:
            raw.extend(s.files)
    else:
        raw = [cfg.input] if isinstance(cfg.input, str) else list(cfg.input)
    ingested = [p for p in raw if _is_ingested(p)]
    roots = [p for p in raw if p not in ingested]
    for d in ingested:
        d = os.path.abspath(os.path.expanduser(d))
        rep = read_json(os.path.join(d, "_report.json"))
        have = set(rep.get("branches", []))
        lacking = [b for b in required if b not in have]
        if lacking:
            raise BadInputError(f"{d}: ingested dataset lacks column {lacking[0]!r} (ingest the branches of "
                                "pipeline.features.delphes.REQUIRED_BRANCHES)")
        for f in rep["files"]:
            if f.get("error"):
                notes.append(f"{f['file']}: skipped, ingestion failed: {f['error']}")
                continue
            info = FileInfo(len(files), f["file"], entries=int(f["entries"]))
            files.append(info)
            for part in f["parts"]:
                units.append(Chunk(len(units), info.file_index, os.path.join(d, part["part"]), "",
                                   int(part["entry_start"]), int(part["entry_stop"])))
                info.chunks += 1
    if roots:
        for path in resolve_files(roots):
            info = FileInfo(len(files), path)
            files.append(info)
            units.append(Chunk(len(units), info.file_index, path, cfg.tree, WHOLE_FILE, WHOLE_FILE))
    labels: dict[int, int] = {}
    for f in files:
        lab = label_of(f.path, cfg.samples)
        if lab is None and not f.error:
            f.error = "no sample label: the path matches none of samples[].files"
            log.warning("bad input file %s: %s", f.path, f.error)
        labels[f.file_index] = -1 if lab is None else lab
    bad = {f.file_index for f in files if f.error}
    units = [u for u in units if u.file_index not in bad]
    units = [Chunk(i, u.file_index, u.path, u.tree, u.entry_start, u.entry_stop) for i, u in enumerate(units)]
    return files, units, labels, notes


# --------------------------------------------------------------------------------------------
# the Spark task
# --------------------------------------------------------------------------------------------

def _read_unit(path: str, tree: str, a: int, b: int, timeout_s: float = FILE_TIMEOUT_S):
    """The REQUIRED_BRANCHES of one unit as an awkward record array (a ROOT chunk: within ``timeout_s``)."""
    import awkward as ak

    if not tree:   # an ingested Parquet part
        import pyarrow.parquet as pq
        return ak.from_arrow(pq.read_table(path, columns=list(D.REQUIRED_BRANCHES)))
    from ..ingest.root import read_chunk
    return read_chunk(path, tree, list(D.REQUIRED_BRANCHES), a, b, timeout_s)


#: the status row of a work unit (Spark DDL of :func:`_status_schema`): the chunk processed
#: (``entry_start``, ``entry_stop``; :data:`WHOLE_FILE` when none was), for a whole ROOT file its
#: ``entries`` and entry ranges (``starts``, ``stops``; -1 and empty otherwise), the counts, the
#: error, the selected events' HLF and per-event moments
_STATUS_DDL = ("file_index int, entry_start long, entry_stop long, entries long, starts array<long>, "
               "stops array<long>, n_read long, n_selected long, error string, hlf array<float>, stats array<double>")


def _status_schema():
    import pyarrow as pa
    return pa.schema([("file_index", pa.int32()), ("entry_start", pa.int64()), ("entry_stop", pa.int64()),
                      ("entries", pa.int64()), ("starts", pa.list_(pa.int64())), ("stops", pa.list_(pa.int64())),
                      ("n_read", pa.int64()), ("n_selected", pa.int64()), ("error", pa.string()),
                      ("hlf", pa.list_(pa.float32())), ("stats", pa.list_(pa.float64()))])


def _lists(x: np.ndarray):
    import pyarrow as pa
    n, w = x.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * w, pa.int32()),
                                    pa.array(np.ascontiguousarray(x, np.float32).reshape(-1), pa.float32()))


def llf_lists(llf: np.ndarray, n_particles: np.ndarray):
    """The ``llf`` column of schema v3 from padded ``(k, LLF_SIZE)`` blocks: each event's first
    ``n_particles`` rows of 19 features (its real particles), flattened particle-major."""
    import pyarrow as pa

    width = np.asarray(n_particles, np.int64) * N_LLF_FEATURES
    x = np.asarray(llf, np.float32).reshape(len(width), LLF_SIZE)
    # slices of the real rows only: the zero padding (most of the block, mostly never touched) is not read
    values = (np.concatenate([x[i, :w] for i, w in enumerate(width.tolist())]) if len(width)
              else np.zeros(0, np.float32))
    offsets = np.zeros(len(width) + 1, np.int32)
    np.cumsum(width, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.float32()))


#: per selected event, the status row's ``stats``: n_particles, then the mean and the M2 of each LLF
#: feature over the event's real particles (the partial moments of the scaling fit)
N_STATS = 1 + 2 * N_LLF_FEATURES


def _event_stats(block) -> np.ndarray:
    """(k, N_STATS) float64 partial moments of the selected events of one chunk."""
    from .kernels import event_moments

    k = len(block.index)
    mean, m2 = event_moments(block.llf.reshape(k, N_PARTICLES, N_LLF_FEATURES), block.n_particles)
    return np.column_stack([block.n_particles.astype(np.float64), mean, m2]).reshape(k, N_STATS)


#: rows per record batch of a work file: the LLF writer holds one batch (about 16 MB) at a time
_IPC_BATCH_ROWS = 256


def _work_name(file_index: int, entry_start: int) -> str:
    """The work file (in the work directory) where the feature task of a chunk leaves its selected
    events (Arrow IPC) for the LLF writers."""
    return f"chunk-{file_index:06d}-{entry_start:012d}.arrow"


@functools.lru_cache(maxsize=None)
def _ipc_options(compression: str):
    import pyarrow as pa
    return pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)


def _save_block(block, path: str, batch_rows: int = _IPC_BATCH_ROWS, *, compression: str) -> None:
    """The selected events' llf (real particles, :func:`llf_lists`), n_particles, hlf in event
    order, as one Arrow IPC file (``compression``: none, lz4 or zstd buffers), written under a
    temporary name and renamed, so a retried task never leaves half a file."""
    import pyarrow as pa

    table = pa.table({"llf": llf_lists(block.llf, block.n_particles),
                      "n_particles": pa.array(block.n_particles, pa.int32()), "hlf": _lists(block.hlf)})
    tmp = f"{path}.{os.getpid()}.tmp"
    options = _ipc_options(compression)
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    os.replace(tmp, path)


def _feature_partition(batches: Iterator, *, work_dir: str, step_size: Union[int, str] = "50 MB",
                       file_timeout_s: float = FILE_TIMEOUT_S, batch_rows: int = _IPC_BATCH_ROWS,
                       compression: str) -> Iterator:
    """Per work unit (``file_index, path, tree, entry_start, entry_stop``): a whole ROOT file
    (:data:`WHOLE_FILE`) is opened and cut into ``step_size`` chunks (at most ``file_timeout_s``
    to open it); when it is one chunk it is processed on the same open tree, otherwise only its
    ranges come back. A chunk is read (at most ``file_timeout_s``), selected and computed; its
    selected events go to its work file (:func:`_work_name`); one status row comes back
    (:func:`_status_schema`)."""
    import pyarrow as pa

    from ..ingest.root import plan_file, read_arrays, read_deadline

    mode, size = parse_step_size(step_size)
    required = list(D.REQUIRED_BRANCHES)
    schema = _status_schema()
    for batch in batches:
        d = batch.to_pydict()
        for fi, path, tree, a, b in zip(d["file_index"], d["path"], d["tree"], d["entry_start"], d["entry_stop"]):
            err, n_read, n_sel, hlf, stats, block = None, 0, 0, [], [], None
            entries, ranges, ev = -1, [], None
            try:
                if a == WHOLE_FILE:
                    with read_deadline(file_timeout_s):
                        t, _, entries, ranges, _ = plan_file(path, tree, required, required, mode, size)
                        if len(ranges) == 1:   # one chunk: processed here, on the open tree, as that chunk
                            ev = read_arrays(t, required, *ranges[0])
                            a, b = ranges[0]
                else:
                    ev = _read_unit(path, tree, a, b, file_timeout_s)
                if ev is not None:
                    block = D.compute_features(ev)
                    n_read, n_sel = block.n_read, len(block.index)
                    hlf, stats = block.hlf.reshape(-1), _event_stats(block).reshape(-1)
            except Exception as e:  # noqa: BLE001 - the driver reports the file
                err = str(e) if isinstance(e, (BadInputError, ReadTimeout)) else f"{type(e).__name__}: {first_line(e)}"
                n_sel, hlf, stats = 0, [], []
            if n_sel:  # outside the try: a full disk fails the stage, it is not the input file's fault
                _save_block(block, os.path.join(work_dir, _work_name(fi, a)), batch_rows, compression=compression)
            yield pa.RecordBatch.from_pydict({
                "file_index": [fi], "entry_start": [a], "entry_stop": [b], "entries": [entries],
                "starts": [[x for x, _ in ranges]], "stops": [[y for _, y in ranges]], "n_read": [n_read],
                "n_selected": [n_sel], "error": [err],
                "hlf": pa.ListArray.from_arrays(pa.array([0, len(hlf)], pa.int32()), pa.array(hlf, pa.float32())),
                "stats": pa.ListArray.from_arrays(pa.array([0, len(stats)], pa.int32()),
                                                  pa.array(stats, pa.float64()))},
                schema=schema)


#: Parquet writer options of hlf/ and llf/ (pyarrow): snappy; no dictionary encoding and no
#: statistics for the float lists (their values rarely repeat, and min/max over a list's elements
#: help no reader)
_FLOAT_LISTS = ("hlf", "llf")


def _parquet_options(schema) -> dict:
    plain = [f.name for f in schema if f.name not in _FLOAT_LISTS]
    return {"compression": "snappy", "use_dictionary": plain, "write_statistics": plain}


def _output_schema(with_llf: bool):
    """The Arrow schema of hlf/ (``with_llf`` False) or llf/ rows (see ``schemas/hlf``, ``schemas/llf``)."""
    import pyarrow as pa
    cols = [pa.field("sample_id", pa.int64(), False), pa.field("label", pa.int64(), False),
            pa.field("split", pa.string(), False)]
    if with_llf:
        from ..schemas import PAD_KEY

        cols += [pa.field("llf", pa.list_(pa.float32()), False, metadata={PAD_KEY: str(LLF_SIZE).encode()}),
                 pa.field("n_particles", pa.int32(), False)]
    return pa.schema(cols + [pa.field("hlf", pa.list_(pa.float32()), False)])


def _rows_per_group(row_group_mb: float, row_bytes: int) -> int:
    return max(1, int(row_group_mb * (1 << 20)) // row_bytes)


#: bytes of one written row (values only; an LLF row adds its list offset, n_particles and
#: 4 x 19 bytes per particle: :func:`_llf_row_bytes`)
_HLF_ROW_BYTES = 8 + 8 + 8 + 4 * N_HLF
_LLF_ROW_BASE = _HLF_ROW_BYTES + 4 + 4


def _llf_row_bytes(n_particles) -> np.ndarray:
    return _LLF_ROW_BASE + 4 * N_LLF_FEATURES * np.asarray(n_particles, np.int64)


def _split_names(codes: np.ndarray):
    import pyarrow as pa
    return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int8()), pa.array(SPLITS)).cast(pa.string())


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


class _RowGroups:
    """Buffers LLF rows for a ParquetWriter and writes row groups of at most ``budget`` bytes of
    values (:func:`row_group_cuts`; the last one of the file may be smaller): small tables from
    many chunks never make small row groups."""

    def __init__(self, writer, budget: int) -> None:
        self.writer, self.budget, self.pending, self.sizes, self.bytes = writer, budget, [], [], 0

    def add(self, table) -> None:
        self.pending.append(table)
        self.sizes.append(_llf_row_bytes(table.column("n_particles").to_numpy()))
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


def _llf_partition(batches: Iterator, *, work_dir: str, out_dir: str, row_group_bytes: int) -> Iterator:
    """One LLF file per group of consecutive chunks: each chunk's work file, batch by batch, its
    rows filtered and given ``sample_id`` (offset + position), ``label`` and ``split`` from the
    driver's assignment (``codes``: the split index per selected event, -1 where balancing drops
    it), written in row groups of at most ``row_group_bytes``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _output_schema(True)
    for batch in batches:
        d = batch.to_pydict()
        for gid, works, offsets, labels, codes in zip(d["group"], d["works"], d["offsets"], d["labels"],
                                                      d["codes"]):
            codes_all = np.frombuffer(codes, np.int8)
            name = os.path.join(out_dir, f"part-{gid:05d}.parquet")
            tmp, rows, at = f"{name}.{os.getpid()}.tmp", 0, 0
            with pq.ParquetWriter(tmp, schema, **_parquet_options(schema)) as writer:
                out = _RowGroups(writer, row_group_bytes)
                for work, off, lab in zip(works, offsets, labels):
                    with pa.OSFile(os.path.join(work_dir, work)) as src:  # read, not mapped: rows outlive the file
                        reader = pa.ipc.open_file(src)
                        pos = 0
                        for i in range(reader.num_record_batches):
                            t = reader.get_batch(i)
                            m = t.num_rows
                            c = codes_all[at + pos:at + pos + m]
                            keep = np.flatnonzero(c >= 0)
                            if len(keep):
                                t = t.take(pa.array(keep)) if len(keep) < m else t
                                out.add(pa.table({
                                    "sample_id": pa.array(keep.astype(np.int64) + off + pos, pa.int64()),
                                    "label": pa.array(np.full(len(keep), lab, np.int64)),
                                    "split": _split_names(c[keep]), "llf": t.column("llf"),
                                    "n_particles": t.column("n_particles"), "hlf": t.column("hlf")}, schema=schema))
                                rows += len(keep)
                            pos += m
                        at += pos
                out.close()
            os.replace(tmp, name)
            yield pa.RecordBatch.from_arrays([pa.array([gid], pa.int32()), pa.array([rows], pa.int64())],
                                             names=["group", "rows"])


# --------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------

def plan_features(cfg: FeaturesConfig) -> dict:
    """--dry-run: inputs and outputs (Spark is not started)."""
    from ..fs import location

    out = location(cfg.output, output=True)
    raw = cfg.input if cfg.input is not None else [f for s in cfg.samples for f in s.files]
    return {"inputs": raw, "samples": [s.model_dump() for s in cfg.samples],
            "required_branches": list(D.REQUIRED_BRANCHES),
            "outputs": {"hlf": str(out.child("hlf")), "llf": str(out.child("llf")),
                        "scaling": str(out.child("scaling.json")), "report": str(out.child("report.json"))}}


@dataclass
class _Tally:
    """Per-chunk statuses folded into per-file and per-class counts (bad files excluded)."""

    offsets: dict            # chunk_id -> first sample_id of the chunk
    first_id: dict           # file_index -> first sample_id of the file
    per_label: dict          # label -> selected events
    selected: dict           # file_index -> selected events
    read: dict               # file_index -> events read


#: a Spark task of the feature pass gets consecutive work units up to about this many entries
#: (about 7 s of work for simulated ttbar): each task costs Spark 0.2-0.3 s on 2 cores, and on
#: 64,000 events the stage reached 0.61x the bare rate per core with tasks of 50,000 entries
#: against 0.55x with 10,000 (bench/features.py --stage-files 32)
TASK_ENTRIES = 50_000
#: before a ROOT file is opened its entries are estimated from its size: bytes per entry of the
#: simulated Delphes files (about 4 kB); a file whose size cannot be read counts as TASK_ENTRIES
BYTES_PER_ENTRY = 4096


def _unit_entries(u: Chunk) -> int:
    """The entries of a work unit, estimated for a whole ROOT file (:data:`BYTES_PER_ENTRY`)."""
    if u.entry_start != WHOLE_FILE:
        return u.entry_stop - u.entry_start
    try:
        return max(1, os.path.getsize(u.path) // BYTES_PER_ENTRY)
    except OSError:        # remote (root://, s3://): one task each
        return TASK_ENTRIES


def pack_units(entries: list[int], slots: int, task_entries: int = TASK_ENTRIES) -> list[int]:
    """The task of each unit: consecutive units packed into about ``total / task_entries`` tasks,
    rounded up to a multiple of ``slots`` (so that the last wave of tasks keeps every slot busy;
    never more tasks than units), balanced by entries."""
    slots = max(1, slots)
    k = math.ceil(max(1, math.ceil(sum(entries) / max(1, task_entries))) / slots) * slots
    return balanced_tasks(entries, k)


def balanced_tasks(entries: list[int], k: int) -> list[int]:
    """The task of each unit: consecutive units in ``min(k, len(entries))`` tasks, each task ended
    once it has its share of the entries."""
    n = len(entries)
    total = sum(entries)
    k = max(1, min(n, k))
    out, done, task = [], 0, 0
    for e in entries:
        # move on when this task has its share of what is left
        if out and done >= (task + 1) * total / k and task < k - 1 and n - len(out) >= k - task - 1:
            task += 1
        out.append(task)
        done += e
    return out


def _feature_pass(spark, units: list[Chunk], work_dir: Path, cfg: FeaturesConfig) -> list[dict]:
    """One Spark job of :func:`_feature_partition` over the work units: their status rows, with
    ``hlf`` (k, N_HLF) and ``stats`` (k, N_STATS) as numpy arrays. The selected events themselves
    wait in ``work_dir`` (one Arrow file per chunk)."""
    fn = functools.partial(_feature_partition, work_dir=str(work_dir), step_size=cfg.step_size,
                           file_timeout_s=cfg.file_timeout_s,
                           batch_rows=_IPC_BATCH_ROWS,  # read at call time: a test may shrink it
                           compression=cfg.work_compression)
    tasks = pack_units([_unit_entries(u) for u in units], spark.sparkContext.defaultParallelism)
    rows = [(u.file_index, u.path, u.tree, u.entry_start, u.entry_stop) for u in units]
    df = task_frame(spark, rows, "file_index int, path string, tree string, entry_start long, entry_stop long", tasks)
    table = df.mapInArrow(spark_task(fn), _STATUS_DDL).toArrow()
    out = []
    for i in range(table.num_rows):
        s = {c: table.column(c)[i].as_py() for c in ("file_index", "entry_start", "entry_stop", "entries", "starts",
                                                      "stops", "n_read", "n_selected", "error")}
        s["hlf"] = table.column("hlf")[i].values.to_numpy(zero_copy_only=False).reshape(-1, N_HLF)
        s["stats"] = table.column("stats")[i].values.to_numpy(zero_copy_only=False).reshape(-1, N_STATS)
        out.append(s)
    return out


def _run_units(spark, files: list[FileInfo], units: list[Chunk], work_dir: Path, cfg: FeaturesConfig,
               t_start: float) -> tuple[list[Chunk], dict]:
    """The feature pass over the work units, and a second one over the chunks of the ROOT files
    that are more than one chunk: (every chunk processed, in (file, entry) order and numbered so;
    {chunk_id: status}). The files' entries, chunk counts and errors are filled in ``files``."""
    rows = _feature_pass(spark, units, work_dir, cfg) if units else []
    more = []
    for r in rows:
        f = files[r["file_index"]]
        if r["entries"] >= 0:            # a whole ROOT file, opened by its task
            f.entries, f.chunks = int(r["entries"]), len(r["starts"])
        if r["entry_start"] == WHOLE_FILE and r["starts"] and not r["error"]:
            more += [Chunk(0, f.file_index, f.path, cfg.tree, a, b) for a, b in zip(r["starts"], r["stops"])]
    if more:
        log.info("features: %d chunk(s) of %d large file(s) -> a second pass", len(more),
                 len({c.file_index for c in more}))
        rows += _feature_pass(spark, more, work_dir, cfg)
    for r in rows:
        f = files[r["file_index"]]
        if r["error"] and not f.error:
            f.error = r["error"]
            log.warning("bad input file %s: %s", f.path, f.error)
    done = sorted((r for r in rows if r["entry_start"] != WHOLE_FILE),
                  key=lambda r: (r["file_index"], r["entry_start"]))
    chunks = [Chunk(i, r["file_index"], files[r["file_index"]].path, cfg.tree, r["entry_start"], r["entry_stop"])
              for i, r in enumerate(done)]
    log.info("features: selection and features of %d chunk(s) done (%.1f s)", len(chunks), time.time() - t_start)
    return chunks, dict(enumerate(done))


def _tally(files: list[FileInfo], units: list[Chunk], labels: dict, st: dict) -> _Tally:
    """Give each chunk of a good file (no failed chunk: :func:`_run_units` marked those) its
    contiguous sample_id range, and count per file and class."""
    bad = {f.file_index for f in files if f.error}
    t = _Tally({}, {}, {lab: 0 for lab in range(N_CLASSES)}, {f.file_index: 0 for f in files},
               {f.file_index: 0 for f in files})
    next_id = 0
    for u in units:   # units are in (file, entry) order
        if u.file_index in bad:
            continue
        t.offsets[u.chunk_id] = next_id
        t.first_id.setdefault(u.file_index, next_id)
        next_id += int(st[u.chunk_id]["n_selected"])
    unit_file = {u.chunk_id: u.file_index for u in units}
    for cid, s in st.items():
        fi = unit_file[cid]
        t.read[fi] += int(s["n_read"] or 0)
        if fi not in bad:
            t.selected[fi] += int(s["n_selected"])
            t.per_label[labels[fi]] += int(s["n_selected"])
    return t


@dataclass
class _Selected:
    """Every selected event of the good files, in sample_id order, gathered once from the statuses."""

    labels: np.ndarray       # (n,) int64
    hlf: np.ndarray          # (n, N_HLF) float32
    stats: np.ndarray        # (n, N_STATS) float64


def _selected(units: list[Chunk], labels: dict, st: dict, t: _Tally) -> _Selected:
    done = [u for u in units if u.chunk_id in t.offsets]
    return _Selected(
        np.repeat(np.array([labels[u.file_index] for u in done], np.int64),
                  [int(st[u.chunk_id]["n_selected"]) for u in done]),
        np.concatenate([st[u.chunk_id]["hlf"] for u in done]) if done else np.zeros((0, N_HLF), np.float32),
        np.concatenate([st[u.chunk_id]["stats"] for u in done]) if done else np.zeros((0, N_STATS)))


def _assign(sel: _Selected, t: _Tally, cfg: FeaturesConfig) -> Assignment:
    """The split (and balancing) of every selected event, in sample_id order, on the driver."""
    return assign(sel.labels, list(t.per_label), cfg.seed, cfg.test_fraction, cfg.val_fraction, cfg.balance_classes)


def _written_counts(units: list[Chunk], st: dict, t: _Tally, asg: Assignment) -> tuple[dict, dict]:
    """({file_index: events written}, {split: events written})."""
    per_file: dict = {}
    for u in units:
        if u.chunk_id in t.offsets:
            o = t.offsets[u.chunk_id]
            n = int(st[u.chunk_id]["n_selected"])
            per_file[u.file_index] = per_file.get(u.file_index, 0) + int(asg.keep[o:o + n].sum())
    per_split = np.bincount(asg.split[asg.keep].astype(np.int64), minlength=len(SPLITS))
    return per_file, {s: int(per_split[i]) for i, s in enumerate(SPLITS)}


def _scaling(sel: _Selected, asg: Assignment):
    """The scaling model of the written train events, from the tasks' per-event partial moments."""
    from .scaling import scaling_from_events

    train = (asg.split == SPLITS.index("train")) & asg.keep
    x = sel.stats[train]
    return scaling_from_events(sel.hlf[train], x[:, 0], x[:, 1:1 + N_LLF_FEATURES], x[:, 1 + N_LLF_FEATURES:])


def _codes(asg: Assignment) -> np.ndarray:
    """Per selected event (sample_id order): its split index, -1 where balancing drops it."""
    return np.where(asg.keep, asg.split, -1).astype(np.int8)


def _write_hlf(path: Path, sel: _Selected, codes: np.ndarray, cfg: FeaturesConfig) -> None:
    """``hlf/`` on the driver, from the tasks' statuses (the driver holds every selected event's
    HLF for the scaling fit): ``file_mb`` files, row groups of ``hlf_row_group_mb``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    keep = np.flatnonzero(codes >= 0)
    schema = _output_schema(False)
    table = pa.table({"sample_id": pa.array(keep.astype(np.int64)), "label": pa.array(sel.labels[keep]),
                      "split": _split_names(codes[keep]), "hlf": _lists(sel.hlf[keep].astype(np.float32))},
                     schema=schema)
    path.mkdir(parents=True, exist_ok=True)
    n_files = max(1, math.ceil(len(keep) * _HLF_ROW_BYTES / (cfg.file_mb << 20)))
    per_file = max(1, math.ceil(len(keep) / n_files))
    rows = _rows_per_group(cfg.hlf_row_group_mb, _HLF_ROW_BYTES)
    for i in range(n_files):
        pq.write_table(table.slice(i * per_file, per_file), path / f"part-{i:05d}.parquet", row_group_size=rows,
                       **_parquet_options(schema))


def _llf_groups(units: list[Chunk], st: dict, t: _Tally, codes: np.ndarray, labels: dict, cfg: FeaturesConfig,
                slots: int) -> list[tuple]:
    """Consecutive chunks packed into LLF files of about ``file_mb`` at most, their number rounded
    up to a multiple of ``slots`` when there are that many chunks (so every task slot writes),
    each file closed once the next chunk would exceed an even share; task descriptors
    (group, work file names, sample_id offsets, labels, split codes)."""
    done = [u for u in units if u.chunk_id in t.offsets and int(st[u.chunk_id]["n_selected"])]
    sizes = []
    for u in done:
        o, n = t.offsets[u.chunk_id], int(st[u.chunk_id]["n_selected"])
        sizes.append(int(_llf_row_bytes(st[u.chunk_id]["stats"][:, 0])[codes[o:o + n] >= 0].sum()))
    total = sum(sizes)
    n_files = max(1, math.ceil(total / (cfg.file_mb << 20)))
    if len(done) > n_files:   # a multiple of the task slots, so that no slot idles while another writes two
        n_files = min(len(done), math.ceil(n_files / max(1, slots)) * max(1, slots))
    target = max(1, math.ceil(total / n_files))
    groups = [[done[i] for i in g] for g in consecutive_groups(sizes, target)]
    out = []
    for g, us in enumerate(groups):
        offs = [int(t.offsets[u.chunk_id]) for u in us]
        c = np.concatenate([codes[o:o + int(st[u.chunk_id]["n_selected"])] for u, o in zip(us, offs)])
        out.append((g, [_work_name(u.file_index, u.entry_start) for u in us], offs,
                    [int(labels[u.file_index]) for u in us], c.tobytes()))
    return out


def _write_llf(spark, path: Path, work_dir: Path, groups: list[tuple], cfg: FeaturesConfig) -> None:
    """``llf/``: each group becomes one Parquet file written with pyarrow (row groups of at most
    ``llf_row_group_mb``) from its chunks' work files; the groups are packed into one Spark task
    per task slot."""
    path.mkdir(parents=True, exist_ok=True)
    if not groups:  # nothing selected: one empty file, so that readers still see the columns
        import pyarrow.parquet as pq

        schema = _output_schema(True)
        pq.write_table(schema.empty_table(), path / "part-00000.parquet", **_parquet_options(schema))
        return
    fn = functools.partial(_llf_partition, work_dir=str(work_dir), out_dir=str(path),
                           row_group_bytes=max(1, int(cfg.llf_row_group_mb * (1 << 20))))
    tasks = balanced_tasks([len(g[4]) for g in groups], spark.sparkContext.defaultParallelism)
    df = task_frame(spark, groups, "group int, works array<string>, offsets array<long>, labels array<long>, "
                                   "codes binary", tasks)
    written = {r["group"]: r["rows"] for r in df.mapInArrow(spark_task(fn), "group int, rows long").collect()}
    for g in groups:    # every kept event in its file: a work file lost or cut short is not silent
        want = int((np.frombuffer(g[4], np.int8) >= 0).sum())
        if written.get(g[0]) != want:
            raise RuntimeError(f"llf/part-{g[0]:05d}.parquet: {written.get(g[0])} rows written, the assignment "
                               f"keeps {want} (work files {g[1][0]} .. {g[1][-1]})")


def _per_file(files: list[FileInfo], labels: dict, t: _Tally, written: dict) -> list[dict]:
    out = []
    for f in files:
        fi = f.file_index
        ids = [t.first_id[fi], t.first_id[fi] + t.selected[fi] - 1] if fi in t.first_id and t.selected[fi] else None
        out.append({"file": f.path, "label": labels.get(fi), "events_read": t.read[fi],
                    "selected": 0 if f.error else t.selected[fi], "written": 0 if f.error else written[fi],
                    "sample_ids": ids, "error": f.error})
    return out


def build_features(cfg: FeaturesConfig, spark=None) -> dict:
    """Run the stage; returns {"files": [...per-file counts...], "hlf": path, "llf": path,
    "scaling": path, "report": path, "splits": {...}}. See the module docstring."""
    from ..fs import check_writable, location
    from ..outputs import atomic_output_dir, check_staging, write_json
    from ..schemas import SCHEMA_DIR, load_schema, validate_parquet
    from ..spark import get_spark

    t_start = time.time()
    schema_dir = Path(cfg.schema_dir) if cfg.schema_dir else SCHEMA_DIR
    for name in ("hlf", "llf"):       # a missing or broken schema fails before any work
        load_schema(name, SCHEMA_VERSIONS[name], schema_dir)
    files, units, labels, notes = plan_units(cfg)
    for n in notes:
        log.info("%s", n)
    if not [f for f in files if not f.error]:
        first = files[0] if files else None
        raise BadInputError(f"no input file could be used; {first.path}: {first.error}" if first
                            else "no input files")
    out = location(cfg.output, output=True)  # a local path or s3:// (staged on the driver's disk)
    check_writable(out)
    spark = spark or get_spark(cfg.spark)
    check_staging(spark.sparkContext.master, out, "feature")
    log.info("features: %d work unit(s) from %d file(s) -> Spark tasks", len(units), len(files))
    with atomic_output_dir(out) as tmp:
        work = tmp / "_work"    # the selected events between the Spark passes (removed before commit)
        work.mkdir()
        units, st = _run_units(spark, files, units, work, cfg, t_start)
        if not [f for f in files if not f.error]:    # nothing to write: no output at all
            first = files[0]
            raise BadInputError(f"no input file could be used; {first.path}: {first.error}")
        tally = _tally(files, units, labels, st)
        sel = _selected(units, labels, st, tally)
        asg = _assign(sel, tally, cfg)
        counts, n_written = asg.counts, int(asg.keep.sum())
        wr, split_counts = _written_counts(units, st, tally, asg)
        wr_file = {f.file_index: wr.get(f.file_index, 0) for f in files}
        model = _scaling(sel, asg)
        model.save(tmp / "scaling.json")
        log.info("features: split%s and scaling (%d train events) done (%.1f s)",
                 " and balancing" if cfg.balance_classes else "", model.hlf_count, time.time() - t_start)
        codes = _codes(asg)
        _write_hlf(tmp / "hlf", sel, codes, cfg)
        groups = _llf_groups(units, st, tally, codes, labels, cfg, spark.sparkContext.defaultParallelism)
        _write_llf(spark, tmp / "llf", work, groups, cfg)
        shutil.rmtree(work)
        # the schema from the Parquet footers; the values' constraints (no nulls, list lengths) hold
        # by construction: every row comes from numpy blocks of fixed width or of 19 x n_particles
        for name in ("hlf", "llf"):
            validate_parquet(tmp / name, load_schema(name, SCHEMA_VERSIONS[name], schema_dir), check_data=False)
        log.info("features: hlf/ and llf/ written (%d LLF file(s)) (%.1f s)", len(groups), time.time() - t_start)
        per_file = _per_file(files, labels, tally, wr_file)
        report = {"job": "features", "files": per_file,
                  "bad_files": [{"file": p["file"], "reason": p["error"]} for p in per_file if p["error"]],
                  "notes": notes, "splits": split_counts,
                  "classes": {str(lab): {s: counts[(s, lab)] for s in ("train", "val", "test")}
                              for lab in tally.per_label},
                  "seed": cfg.seed, "balance_classes": cfg.balance_classes,
                  "hlf": str(out.child("hlf")), "llf": str(out.child("llf")),
                  "scaling": str(out.child("scaling.json")), "report": str(out.child("report.json")), "hlf_names": list(HLF_NAMES), "llf_names": list(LLF_NAMES),
                  "seconds": round(time.time() - t_start, 3)}
        write_json(tmp / "report.json", report)
    _finish(report, out, len(files), n_written, split_counts, cfg.allow_bad_files)
    return report


def _finish(report: dict, out, n_files: int, n_written: int, split_counts: dict, allow_bad: bool) -> None:
    """One line per file on stdout; BadInputError naming the first bad file unless ``allow_bad``."""
    for p in report["files"]:
        state = f" FAILED: {p['error']}" if p["error"] else ""
        print(f"{p['file']}: {p['events_read']} events read, {p['selected']} selected, {p['written']} written{state}")
    log.info("features: %d events written (train %d, val %d, test %d) -> %s", n_written, split_counts["train"],
             split_counts["val"], split_counts["test"], out)
    if report["bad_files"] and not allow_bad:
        b = report["bad_files"][0]
        raise BadInputError(f"{len(report['bad_files'])} of {n_files} input file(s) failed (see "
                            f"{out}/report.json); {b['file']}: {b['reason']}")
