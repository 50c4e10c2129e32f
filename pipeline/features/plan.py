"""Planning the feature stage on the driver, without opening a ROOT file: the input files and
their labels, the work units (a whole ROOT file, cut by its own task, or a part of an ingested
dataset) and how consecutive units are packed into Spark tasks."""
from __future__ import annotations

import fnmatch
import logging
import math
import os
from typing import Optional

from ..committed import require_complete, resolve
from ..errors import BadInputError, ConfigError
from ..fs import confined, is_file, location
from ..ingest.root import SAMPLES_PREFIX, Chunk, FileInfo, resolve_files, sample_path
from ..outputs import read_json
from ..paths_overlap import check_apart
from ..redact import expand_path
from ..packing import balanced_tasks
from ..tables.snapshot import is_delta_table, ledger, snapshot
from . import delphes as D
from .config import FeaturesConfig, SampleSpec

log = logging.getLogger(__name__)

#: ``entry_start`` of a work unit that is a whole ROOT file, planned by its task
WHOLE_FILE = -1
#: a Spark task of the feature pass gets consecutive work units up to about this many entries
#: (docs/hep-features.md: fewer, longer tasks amortise Spark's fixed cost per task)
TASK_ENTRIES = 50_000
#: before a ROOT file is opened its entries are estimated from its size: bytes per entry of the
#: simulated Delphes files (about 4 kB); a file whose size cannot be read counts as TASK_ENTRIES
BYTES_PER_ENTRY = 4096


def _expand_pattern(p: str) -> str:
    """A sample's file pattern as :func:`label_of` matches it: ``samples:NAME`` as its path, a
    URL as it is, a path with its variables, ``~`` and, unless it starts with a glob, its
    directory expanded."""
    if p.startswith(SAMPLES_PREFIX):
        return sample_path(p)
    if "://" in p:
        return p
    p = expand_path(p)
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


def is_ingested(p: str) -> bool:
    """``p`` is an ingested dataset (a local path, a shared mount or ``s3://``: it holds the
    ingestion's ``_report.json``)."""
    if "://" in p and p.split("://", 1)[0].lower() not in ("s3", "s3a", "s3n", "file"):   # s3a: Spark's s3
        return False
    if "*" in p or "?" in p or "[" in p:
        return False
    try:
        return is_file(resolve(location(os.path.expanduser(p)).child("_report.json")))
    except BadInputError:        # an S3 location without credentials: not readable as a dataset
        return False


def _ingested_units(d: str, files: list[FileInfo], units: list[Chunk], notes: list[str]) -> None:
    """The parts of one ingested dataset as work units (their entry ranges from its report)."""
    loc = require_complete(location(os.path.expanduser(d)), "ingested dataset")   # s3://: its _COMPLETE
    d = str(loc)
    rep = read_json(str(loc.child("_report.json")))
    have = set(rep.get("branches", []))
    lacking = [b for b in D.REQUIRED_BRANCHES if b not in have]
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
            where = confined(loc, part["part"], loc.child("_report.json"))
            units.append(Chunk(len(units), info.file_index, str(resolve(where)), "",
                               int(part["entry_start"]), int(part["entry_stop"])))
            info.chunks += 1


def _table_units(d: str, version: Optional[int], files: list[FileInfo], units: list[Chunk]) -> int:
    """The data files of a Delta table's snapshot (the newest, or ``version``) as work units: each
    one's ROOT file and entry range from the table's source ledger, never a listing of its folder;
    returns the version read."""
    loc = location(os.path.expanduser(d))
    snap = snapshot(loc, version)
    lacking = [b for b in D.REQUIRED_BRANCHES if b not in snap.schema.names]
    if lacking:
        raise BadInputError(f"{loc}: the Delta table lacks column {lacking[0]!r} (ingest the branches of "
                            "pipeline.features.delphes.REQUIRED_BRANCHES)")
    live = {f.path for f in snap.files}
    led = ledger(loc, snap.version)
    known = set(led.parts())
    stray = sorted(live - known)
    if stray:
        raise BadInputError(f"{loc.child(stray[0])}: a data file of the Delta table with no source record (not "
                            "written by ingest_root): the feature stage needs each file's ROOT file and entries")
    for s in led.sources.values():                     # in commit order
        parts = sorted((p for p in s.get("parts") or [] if p["path"] in live), key=lambda p: p["entry_start"])
        if not parts:
            continue
        info = FileInfo(len(files), s["file"], entries=int(s["entries"]))
        files.append(info)
        for p in parts:
            units.append(Chunk(len(units), info.file_index, str(confined(loc, p["path"], f"{loc}: the ledger")), "",
                               int(p["entry_start"]), int(p["entry_stop"])))
            info.chunks += 1
    return snap.version


def plan_units(cfg: FeaturesConfig, versions: Optional[dict] = None
               ) -> tuple[list[FileInfo], list[Chunk], dict[int, int], list[str]]:
    """(source files, work units, file_index -> label, notes), without opening a ROOT file: a
    ROOT file is one unit with ``entry_start == entry_stop ==`` :data:`WHOLE_FILE` (its task cuts
    it); an ingested dataset's parts are units with their entry ranges. Files without a sample
    label carry ``error`` and have no unit. ``versions`` receives each Delta table input's
    version read (by its location)."""
    files: list[FileInfo] = []
    units: list[Chunk] = []
    notes: list[str] = []
    raw = ([f for s in cfg.samples for f in s.files] if cfg.input is None
           else [cfg.input] if isinstance(cfg.input, str) else list(cfg.input))
    tables = [p for p in raw if is_delta_table(os.path.expanduser(p))]
    ingested = [p for p in raw if p not in tables and is_ingested(p)]
    if cfg.input_version is not None and not tables:
        raise ConfigError(f"input_version={cfg.input_version} needs a Delta table input")
    roots = [p for p in raw if p not in ingested and p not in tables]
    root_files = resolve_files(roots) if roots else []
    # before any work: the output neither inside nor holding an ingested dataset or a ROOT file
    check_apart(location(cfg.output, output=True),
                [os.path.expanduser(d) for d in tables + ingested] + root_files,
                replaces=cfg.output_format == "parquet")
    for d in tables:
        v = _table_units(d, cfg.input_version, files, units)
        if versions is not None:
            versions[str(location(os.path.expanduser(d)))] = v
    for d in ingested:
        _ingested_units(d, files, units, notes)
    if roots:
        for path in root_files:
            info = FileInfo(len(files), path)
            files.append(info)
            units.append(Chunk(len(units), info.file_index, path, cfg.tree, WHOLE_FILE, WHOLE_FILE))
    labels: dict[int, int] = {}
    for f in files:
        lab = label_of(f.path, cfg.samples)
        if lab is None and not f.error:
            f.error = ("not found" if "://" not in f.path and not os.path.exists(f.path)
                       else "no sample label: the path matches none of samples[].files")
            log.warning("bad input file %s: %s", f.path, f.error)
        labels[f.file_index] = -1 if lab is None else lab
    bad = {f.file_index for f in files if f.error}
    units = [u for u in units if u.file_index not in bad]
    units = [Chunk(i, u.file_index, u.path, u.tree, u.entry_start, u.entry_stop) for i, u in enumerate(units)]
    return files, units, labels, notes


def unit_entries(u: Chunk) -> int:
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
