"""ROOT ingestion into a Delta table (``output_format: delta``): which inputs a run reads
(``mode``: every input, or only the new ones), the partition value of each input, and the record
of the run's inputs that the commit carries (:mod:`pipeline.tables.ledger`)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ...errors import BadInputError
from ...fs import Location
from ...tables import deltalog
from ...tables.job import DeltaJob
from ...tables.ledger import Selection, read_ledger, select_new, source_stat
from ...tables.types import compare
from .config import IngestRootConfig


@dataclass
class TableRun:
    """What a run on a table reads: ``files`` (the inputs to read), the stats of every input, the
    selection (new_files) and the version the table had (None: no table yet)."""

    files: list
    stats: dict
    selection: Optional[Selection] = None
    version: Optional[int] = None
    held: int = 0
    notes: list = field(default_factory=list)
    state: Optional[object] = None        # new_files: the failed inputs (pipeline.tables.quarantine.State)
    quarantined: list = field(default_factory=list)   # new_files: the quarantined inputs this run skips


def select_inputs(cfg: IngestRootConfig, files: list[str], out: Location) -> TableRun:
    """The inputs of a run on the table ``out``: every input (``overwrite``, ``append``) or the
    ones its ledger does not hold (``new_files``; a changed input by ``on_changed``)."""
    stats = {f: source_stat(f, checksum=cfg.input_identity == "checksum") for f in files}
    if cfg.mode != "new_files":
        return TableRun(files, stats, version=None)
    ledger = read_ledger(out)
    sel = select_new(files, stats, ledger, cfg.on_changed, str(out))
    return TableRun(sel.todo, stats, sel, ledger.version, len(sel.unchanged) + len(sel.changed) - len(
        [f for f in sel.changed if f in sel.todo]))


def nothing_new(cfg: IngestRootConfig, run: TableRun, out: Location, n_inputs: int) -> dict:
    """The report of a run with nothing to read (one line printed)."""
    skipped = len(run.selection.changed) if run.selection is not None else 0
    held = "unchanged" if not skipped else f"({skipped} changed since, skipped: on_changed=skip)"
    n_q = len(run.quarantined)
    if n_q:
        held += f"; {n_q} quarantined input file(s) skipped"
    line = (f"{out}: nothing new: the table (version {run.version}) holds all {n_inputs - n_q} input file(s) "
            f"{held}; nothing was written")
    print(line)
    return {"job": "ingest_root", "output_format": "delta", "tree": cfg.tree, "filter_name": cfg.filter_name,
            "output": str(out), "version": run.version, "rows": 0, "files": [], "bad_files": [], "new_files": 0,
            "held_files": run.held, "quarantined_skipped": list(run.quarantined), "nothing_new": True,
            "message": line}


def partition_value(cfg: IngestRootConfig, path: str) -> str:
    """The ``partition_by`` value of the input ``path`` (the first group of ``partition_value``)."""
    m = re.search(cfg.partition_value, path)
    if not m or m.group(1) is None:
        raise BadInputError(f"{path}: partition_value {cfg.partition_value!r} does not match this input's path "
                            f"(it gives the {cfg.partition_by!r} column)")
    return m.group(1)


def check_partitions(cfg: IngestRootConfig, files: list[str], branches: list[str]) -> None:
    """Before any work: every input has a partition value, and no branch has the column's name."""
    if cfg.partition_by is None:
        return
    if cfg.partition_by in branches:
        raise BadInputError(f"partition_by {cfg.partition_by!r} is also a branch of tree {cfg.tree!r}: choose "
                            "another column name")
    for f in files:
        partition_value(cfg, f)


def check_schema(cfg: IngestRootConfig, out: Location, schema, first_file: str) -> None:
    """Before any work: the run's schema (Delta types) against the table's, when there is one
    (:func:`pipeline.tables.types.compare`: a new branch refused by option, a changed type refused).
    The commit checks it again against the version it commits on."""
    if not deltalog.is_table(out):
        return
    snap = deltalog.snapshot(out)
    compare(snap.schema, deltalog.normalized(schema), snap.partition_by, where=str(out), first_file=first_file,
            add_columns=cfg.schema_changes == "add_columns")


def prepare_commit(job: DeltaJob, cfg: IngestRootConfig, run: TableRun, schema, schema_source: str,
                   per_file: list[dict]) -> dict:
    """Hand the job what its log entry needs (schema, rows and partition value per data file,
    files to remove) and return the commit record (the run's good inputs with their parts)."""
    sources = []
    for f in per_file:
        if f.get("error"):
            continue
        value = partition_value(cfg, f["file"]) if cfg.partition_by else None
        parts = []
        for p in f["parts"]:
            rel = p["part"]
            job.rows[rel] = p["rows"]
            if value is not None:
                job.partition_values[rel] = {cfg.partition_by: value}
            parts.append({"path": job.final_name(rel), "rows": p["rows"], "entry_start": p["entry_start"],
                          "entry_stop": p["entry_stop"]})
        sources.append({**run.stats[f["file"]], "entries": f["entries"], "rows": f["rows"], "parts": parts})
    job.schema, job.schema_source = schema, schema_source
    if run.selection is not None:             # new_files: chosen from the ledger of run.version
        job.inputs_chosen_at(run.version)
    replaced = []
    if run.selection is not None and cfg.on_changed == "replace":
        replaced = list(run.selection.replaced)      # the ledger's names of the files read again
        job.removes = list(run.selection.replace)
    job.record = {"stage": "ingest_root", "tree": cfg.tree, "mode": cfg.mode, "sources": sources,
                  "replaced": replaced, "overwrite": cfg.mode == "overwrite",
                  "bad_files": [{"file": f["file"], "reason": f["error"]} for f in per_file if f.get("error")]}
    return job.record


def table_report(job: DeltaJob, cfg: IngestRootConfig, run: TableRun, per_file: list[dict], n_rows: int,
                 branches: list[str], seconds: float) -> dict:
    return {"job": "ingest_root", "output_format": "delta", "tree": cfg.tree, "filter_name": cfg.filter_name,
            "branches": branches, "output": str(job.final), "version": job.version, "mode": cfg.mode,
            "rows": n_rows, "files": per_file, "new_files": len(per_file), "held_files": run.held,
            "bad_files": [{"file": f["file"], "reason": f["error"]} for f in per_file if f.get("error")],
            "seconds": round(seconds, 3)}


def table_version(out: Location) -> Optional[int]:
    return deltalog.snapshot(out).version if deltalog.is_table(out) else None
