"""A job writing several Delta tables in one output folder (the feature stage's ``hlf/`` and ``llf/``,
with ``scaling.json`` and ``report.json`` beside them): one :class:`~.job.DeltaJob` commit per table,
each log entry carrying the run's id and its tables, so a run stopped between two tables' commits is
named (:func:`torn_tables`) and replaced whole by the next run."""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Optional

from ..attempts import JobTarget
from ..commit import OutputJob, _step, committing
from ..errors import BadInputError
from ..fs import Location, check_writable, delete_tree, write_bytes
from ..marker import read_marker
from . import deltalog
from .job import JOBS_DIR, DeltaJob, check_table_target, footer_schema, stale_jobs

log = logging.getLogger(__name__)


class TablesJob(OutputJob):
    """A job whose output folder holds Delta tables (its first-level folders ``tables``) and small
    files beside them (the feature stage's ``hlf/`` and ``llf/`` tables, ``scaling.json``,
    ``report.json``). The tasks write as into any job (``hlf/part-....parquet`` under their
    attempt directories); the commit makes one version of each table (overwrite: it holds this
    run's rows), each log entry carrying the small files as its record (so an older version's
    ``scaling.json`` travels with it), then writes the small files beside the tables."""

    def __init__(self, final, tables: tuple, stage: str) -> None:
        super().__init__(final)
        self.staging = self.final.child(JOBS_DIR, self.job_id)
        self.target = JobTarget(str(self.staging))
        self.tables = tuple(tables)
        self.stage = stage
        self.small: dict[str, bytes] = {}
        self.versions: dict[str, int] = {}
        self._subs: list[DeltaJob] = []

    def begin(self) -> "TablesJob":
        if not self.final.is_local:
            check_writable(self.final)
        if (not self.final.is_local or os.path.isdir(self.final.path)) and read_marker(self.final) is not None:
            raise BadInputError(f"{self.final}: a Parquet output of this pipeline, not a folder of Delta tables: "
                                "choose another output (nothing was changed)")
        for t in self.tables:
            check_table_target(self.final.child(t))
        torn = torn_tables(self.final, self.tables)
        if torn:
            print(f"{torn}; this run replaces them all")
        for d in stale_jobs(self.final, self.job_id):    # a crashed run's prefix (_pipeline/jobs/<job>)
            delete_tree(d)
            log.info("%s: deleted what a stopped job left (%s)", self.final, d.name)
        if self.final.is_local:
            os.makedirs(self.staging.path)
        return self

    def write_bytes(self, rel: str, data: bytes) -> Location:
        """A small file of the driver: kept for the commit (the tables' records, then beside them)."""
        self.small[rel] = data
        return self.final.child(rel)

    def commit(self) -> list[str]:
        record = {"stage": self.stage, "job": self.job_id, "tables_job": self.job_id, "tables": list(self.tables),
                  "overwrite": True,
                  "files": {rel: json.loads(b) for rel, b in self.small.items() if rel.endswith(".json")}}
        names = []
        for t in self.tables:
            files = {rel[len(t) + 1:]: loc for rel, loc in self.kept().items()
                     if rel.startswith(t + "/") and rel.endswith(".parquet")}
            if not files:
                continue
            sub = DeltaJob(self.final.child(t), overwrite=True, what=str(self.final.child(t))).begin()
            self._subs.append(sub)
            sub.adopt_files(files)
            sub.schema = footer_schema(next(iter(files.values())))
            sub.rows = _footer_rows(files)
            sub.schema_source = str(self.final.child(t))
            sub.record = record
            names += [f"{t}/{n}" for n in sub.commit()]
            self.versions[t] = sub.version
        for rel, data in sorted(self.small.items()):
            write_bytes(self.final.child(rel), data)
            _step(f"wrote {rel}")
        delete_tree(self.staging)
        return names

    def abort(self) -> None:
        for sub in self._subs:
            sub.abort()
        delete_tree(self.staging)


def torn_tables(final: Location, tables: tuple) -> Optional[str]:
    """One line when the tables of ``final`` are not all at one run's commit (a run of a
    :class:`TablesJob` stopped between its tables' log entries: the newest versions of some tables
    are that run's, of the others an earlier run's); None when they are."""
    latest = {}
    for t in tables:
        loc = final.child(t)
        recs = deltalog.commits(loc) if deltalog.is_table(loc) else []
        v, rec = max(recs, key=lambda r: r[0]) if recs else (None, {})
        latest[t] = (v, rec.get("tables_job"))
    if len({j for _, j in latest.values()}) < 2:
        return None
    parts = ", ".join(f"{t}/ at version {v} (run {j or 'unknown'})" if v is not None else f"{t}/ absent"
                      for t, (v, j) in latest.items())
    return f"{final}: a run stopped between its tables' commits: {parts}"


def _footer_rows(files: dict) -> dict:
    """The rows of each Parquet file (its footer), by name: the log entry's ``numRecords``."""
    import pyarrow.parquet as pq

    out = {}
    for rel, loc in files.items():
        with loc.filesystem().open_input_file(loc.path) as f:
            out[rel] = pq.ParquetFile(f).metadata.num_rows
    return out


def tables_job(final, tables: tuple, stage: str) -> contextlib.AbstractContextManager[TablesJob]:
    """Begin a job writing the Delta tables ``tables`` inside ``final``; commit when the block ends."""
    return committing(TablesJob(final, tables, stage).begin())
