"""The commit protocol of :mod:`pipeline.commit`, ending in one Delta log entry.

A :class:`DeltaJob` is an :class:`~pipeline.commit.OutputJob` whose output is a Delta table:

1. **A job-scoped prefix inside the table**, ``<table>/_pipeline/jobs/<job>/`` (hidden from Delta
   readers and from ``vacuum`` by its leading ``_``); the table stays as it is. Nothing of another
   job is touched: two jobs may write one table at once.
2. **Attempt-scoped names**, as for every output: each task attempt writes under
   ``_attempts/s<stage>-p<partition>-a<attempt>-t<task attempt id>/`` of that prefix, and Spark's
   results name the files of exactly one successful attempt per task (:meth:`OutputJob.add`).
3. **The commit.** The kept data files are moved to their names in the table
   (``[<column>=<value>/]<name>-<job>.parquet``: a rename locally, a copy on an object store), then
   ONE log entry adds exactly those files (and removes the ones a replaced input held), with the
   stage's record of its inputs as commit metadata (:mod:`.ledger`). The log entry is created
   only if its version does not exist yet (delta-rs: a no-replace rename locally, a conditional
   PUT on S3). If another writer committed first, the commits since are read: when one of them
   ingested one of this job's inputs or removed a file this job removes, the job fails in one
   line and nothing of it is committed; otherwise the entry is retried on the new version.
4. **Exactly once.** The table's contents change only at the log entry, which carries the job's
   inputs with its files: a job stopped before it leaves files no snapshot names (and its inputs
   are still new for the next run); a job stopped after it has committed them all.

   * *The pre-commit ledger check.* A stage that chose its inputs from the table's ledger at
     version P (:meth:`DeltaJob.inputs_chosen_at`) has, before anything is moved, every commit
     after P read: one that holds one of the job's inputs (another run ingested it in between)
     fails the job in one line, nothing moved. The commits after the job's base are read on a
     conflict, so no commit between the choice and the log entry goes unseen.
   * *Own-commit recognition.* A log entry whose outcome the job did not see (on S3 a conditional
     PUT that landed while the client saw an error, and whose retry the store answered 412; or
     any error or stop after the write) is looked up by the job's id in the commit records
     before the job either reports a conflict or deletes anything: when the log holds it, the
     job is committed (that version), and nothing it moved is deleted. When the log cannot be
     read, the moved files and the job's prefix stay for a later job's clean-up, which reads the
     log first.

A stopped job's prefix, and the files it had moved into the table, are deleted by a later job on
the table once they are older than :data:`STALE_S` (a running job's files are never touched: the
jobs keep no lock, so only age tells a dead job from a slow one); ``DeltaTable.vacuum(full=True)``
also removes data files the log does not name.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import time
from typing import Optional
from urllib.parse import quote

from ..attempts import JobTarget
from ..commit import OutputJob, _step, committing
from ..errors import BadInputError
from ..fs import (Location, check_writable, confined, delete_file, delete_tree, list_dirs, list_files,
                  read_bytes_if_exists, write_bytes)
from ..marker import foreign_file, read_marker
from . import deltalog, types
from .ledger import identity

log = logging.getLogger(__name__)

#: where the jobs writing a table keep their prefixes, inside the table
JOBS_DIR = "_pipeline/jobs"
#: the names a job moves into the table, written before the first move (for the clean-up of a stopped job)
MOVING = "_moving.json"
#: a job's prefix older than this (seconds) belongs to a stopped job
STALE_S = 24 * 3600
#: commits retried on a newer version before the job gives up
MAX_RETRIES = 20


def check_table_target(final: Location) -> bool:
    """``final`` may receive a Delta table: True when it holds one, False when it is absent or
    empty; a committed Parquet output of ours or a folder of other files is refused in one line."""
    if deltalog.is_table(final):
        return True
    if (not final.is_local or os.path.isdir(final.path)) and read_marker(final) is not None:
        raise BadInputError(f"{final}: a Parquet output of this pipeline, not a Delta table: choose another "
                            "output for the table (nothing was changed)")
    first = _foreign(final)
    if first is not None:
        raise BadInputError(f"{final}: not a Delta table and not empty (it holds {first}): choose another output "
                            "or remove it yourself; nothing was changed")
    return False


def _foreign(final: Location) -> Optional[str]:
    """The first file under ``final`` that no job on a table would have written there: files of
    other jobs creating the same table (their prefixes, the files they moved in, a log being
    created) are not foreign."""
    if foreign_file(final) is None:
        return None
    names = [posixpath.relpath(f.path, final.path.rstrip("/")) for f in list_files(final)]
    jobs = {n.split("/")[2] for n in names if n.startswith(JOBS_DIR + "/") and n.count("/") >= 3}
    for n in names:
        if n.startswith((JOBS_DIR + "/", deltalog.DELTA_LOG + "/")):
            continue
        m = _MOVED.search(n)
        if m and m.group(1) in jobs:
            continue
        return n
    return None


_MOVED = re.compile(r"-([0-9a-f]{12})\.parquet$")


class DeltaJob(OutputJob):
    """One job appending to (or overwriting) the Delta table ``final``."""

    def __init__(self, final, *, partition_by: tuple = (), overwrite: bool = False, add_columns: bool = True,
                 what: str = "") -> None:
        super().__init__(final)
        self.staging = self.final.child(JOBS_DIR, self.job_id)
        self.target = JobTarget(str(self.staging))
        self.partition_by = tuple(partition_by)
        self.overwrite_table = overwrite
        self.add_columns = add_columns
        self.what = what or str(self.final)
        self.base: Optional[deltalog.Snapshot] = None
        #: set by the stage before the commit: the files' Arrow schema (Delta types), the first input
        #: it came from, the commit record, rows and partition values per kept file, files to remove
        self.schema = None
        self.schema_source = ""
        self.record: dict = {}
        self.rows: dict = {}
        self.partition_values: dict = {}
        self.removes: list = []
        self.partition_types: dict = {}          # column -> Arrow type (default: string)
        self.version: Optional[int] = None
        #: (the version the stage chose the inputs from (None: no table then),) once told: the pre-commit check
        self._chosen_at: Optional[tuple] = None
        self._moved: list[Location] = []
        self._logged = False
        self._adopted: Optional[dict] = None

    # -- life cycle -------------------------------------------------------------------------
    def begin(self) -> "DeltaJob":
        """The target is a Delta table, or absent, or empty; a committed Parquet output or a
        folder of other files is refused in one line, before any work."""
        if not self.final.is_local:
            check_writable(self.final)
        if check_table_target(self.final):
            self.base = deltalog.snapshot(self.final)
            if tuple(self.base.partition_by) != self.partition_by:
                raise BadInputError(f"{self.final}: the table is partitioned by {list(self.base.partition_by)}, "
                                    f"not {list(self.partition_by)} (partition_by)")
            self._clean_stale()
        if self.final.is_local:
            os.makedirs(self.staging.path)
        return self

    def inputs_chosen_at(self, version: Optional[int]) -> None:
        """The stage chose this job's inputs from the table's ledger at ``version`` (None: there was
        no table): before its commit, every commit since is checked for one of its inputs."""
        self._chosen_at = (version,)

    def abort(self) -> None:
        """Delete what this job wrote: its prefix, and the files it moved into the table, once the
        log is read and holds no entry of this job (an entry whose reply was lost names them);
        when the log cannot be read, nothing is deleted (a later job's clean-up reads it)."""
        if self._logged:
            return
        if self._moved:
            try:
                own = self._own_commit()
            except Exception as e:  # noqa: BLE001 - unknown outcome: keep everything
                log.warning("%s: cannot read the log to tell whether this job (%s) committed (%s); its files are "
                            "left for a later job's clean-up", self.what, self.job_id, " ".join(str(e).split())[:200])
                return
            if own is not None:
                self.version, self._logged = own, True
                log.warning("%s: this job's log entry was written (version %d) although its commit reported an "
                            "error; nothing of it is deleted", self.what, own)
                delete_tree(self.staging)
                return
        for loc in self._moved:
            with contextlib.suppress(BadInputError):
                delete_file(loc)
        delete_tree(self.staging)

    def final_name(self, rel: str) -> str:
        """The name in the table of the job's file ``rel`` (a job-unique name, in its partition's
        folder; the partition values are the stage's, or those of ``rel``'s ``<column>=<value>/``
        folders when a task split its rows by them)."""
        stem, ext = posixpath.splitext(posixpath.basename(rel))
        values = self.partition_values.get(rel) or _dir_values(rel)
        dirs = [partition_dir(c, values.get(c)) for c in self.partition_by]
        return posixpath.join(*dirs, f"{stem}-{self.job_id}{ext}")

    def data_files(self) -> dict[str, Location]:
        if self._adopted is not None:
            return dict(self._adopted)
        return {rel: loc for rel, loc in self.kept().items() if rel.endswith(".parquet")}

    def adopt_files(self, files: dict) -> None:
        """Commit these files (name in the table -> where they lie now: another job's kept files)
        instead of this job's own."""
        self._adopted = dict(files)

    # -- the commit -------------------------------------------------------------------------
    def commit(self) -> list[str]:
        """Move the kept data files into the table and add them in one log entry; their names."""
        if self.schema is None:
            raise RuntimeError("DeltaJob.commit: the stage set no schema")
        data = self.data_files()
        sizes = _sizes(list(data.values()))
        finals = {rel: self.final_name(rel) for rel in data}
        if self._chosen_at is not None:       # the pre-commit ledger check: nothing is moved yet
            self._check_commits(self._chosen_at[0], self._inputs())
            live = {f.path for f in self.base.files} if self.base else set()
            gone = [p for p in self.removes if p not in live]
            if gone:
                raise BadInputError(f"{self.what}: another job removed {gone[0]} while this one ran; nothing of "
                                    "this run was committed: rerun it")
        write_bytes(self.staging.child(MOVING), json.dumps(sorted(finals.values())).encode())
        fsys = self.final.filesystem()
        for rel, src in sorted(data.items()):
            dest = self.final.child(finals[rel])
            if self.final.is_local:
                os.makedirs(posixpath.dirname(dest.path), exist_ok=True)
                os.replace(src.path, dest.path)
            else:
                fsys.copy_file(src.path, dest.path)
            self._moved.append(dest)
            _step(f"moved {rel} into the table")
        adds = [{"path": finals[rel], "size": sizes[src.path], "rows": self.rows.get(rel),
                 "partition_values": {c: (self.partition_values.get(rel) or _dir_values(rel)).get(c)
                                      for c in self.partition_by}}
                for rel, src in sorted(data.items())]
        self.version = self._log(adds)
        self._logged = True
        _step(f"committed version {self.version}")
        delete_tree(self.staging)
        _step("deleted the job's prefix")
        return sorted(finals.values())

    def _log(self, adds: list[dict]) -> int:
        """The log entry, retried on a newer version while no commit since conflicts with it."""
        schema = deltalog.normalized(self.schema)
        mine = self._inputs()
        for _ in range(MAX_RETRIES):
            read = self.base.version if self.base else None
            try:
                if self.base is not None:
                    new = types.compare(self.base.schema, schema, self.partition_by, where=self.what,
                                        first_file=self.schema_source, add_columns=self.add_columns)
                    if new:
                        print(f"{self.what}: new column(s) {', '.join(f.name for f in new)} (from "
                              f"{self.schema_source}) added as nullable")
                        read = deltalog.add_columns(self.final, read, new)
                removes = sorted({f.path for f in self.base.files} if (self.overwrite_table and self.base)
                                 else set(self.removes))
                return deltalog.commit(self.final, read, adds, removes, self._table_schema(schema),
                                       list(self.partition_by), {**self.record, "job": self.job_id})
            except deltalog.CommitConflict:
                own = self._after_conflict(read, mine)
                if own is not None:
                    return own
            except Exception:
                own = self._own_commit()          # an unknown outcome: the log says whether it landed
                if own is not None:
                    log.warning("%s: the log entry was written (version %d) although the write reported an error",
                                self.what, own)
                    return own
                raise
        raise BadInputError(f"{self.what}: {MAX_RETRIES} other commits came first; nothing of this run was "
                            "committed: rerun it")

    def _table_schema(self, schema):
        """The table's schema for the log entry: the files' columns plus the partition columns
        (strings, at the end) and any table column the files lack."""
        import pyarrow as pa

        fields = list(schema)
        names = {f.name for f in fields}
        if self.base is not None:
            fields += [f for f in self.base.schema if f.name not in names and f.name not in self.partition_by]
        fields += [pa.field(c, self.partition_types.get(c, pa.string())) for c in self.partition_by]
        return pa.schema(fields)

    def _inputs(self) -> set:
        return {identity(s) for s in self.record.get("sources") or []}

    def _own_commit(self) -> Optional[int]:
        """The version whose commit record carries this job's id (None: the log holds no entry of
        this job, or there is no table)."""
        try:
            entries = deltalog.commits(self.final)
        except deltalog.NoTable:
            return None
        return next((v for v, rec in entries if rec.get("job") == self.job_id), None)

    def _check_commits(self, after: Optional[int], mine: set) -> Optional[int]:
        """Read the commits after version ``after`` (None: every commit): the version of this job's
        own entry when the log holds one; else one line when one of them holds one of this job's
        inputs (nothing of this job is committed)."""
        try:
            entries = [(v, rec) for v, rec in deltalog.commits(self.final) if after is None or v > after]
        except deltalog.NoTable:
            return None
        own = next((v for v, rec in entries if rec.get("job") == self.job_id), None)
        if own is not None:
            return own
        for v, rec in entries:
            clash = sorted(s["file"] for s in rec.get("sources") or [] if not s.get("error") and identity(s) in mine)
            if clash:
                raise BadInputError(f"{self.what}: another job committed {clash[0]} (version {v}) while this one "
                                    "ran; nothing of this run was committed: rerun it to ingest what is still new")
        return None

    def _after_conflict(self, read: Optional[int], mine: set) -> Optional[int]:
        """Another writer committed first: the version of this job's own entry when the log holds
        it (its write landed although it was reported as a conflict); one line when one of the
        commits holds one of this job's inputs or removed a file this job removes; otherwise go on
        from the newest version (None)."""
        latest = deltalog.snapshot(self.final)
        own = self._check_commits(read, mine)
        if own is not None:
            log.warning("%s: the log entry was written (version %d) although the write reported a conflict",
                        self.what, own)
            return own
        live = {f.path for f in latest.files}
        gone = [p for p in self.removes if p not in live]
        if gone:
            raise BadInputError(f"{self.what}: another job removed {gone[0]} (now version {latest.version}) while "
                                "this one ran; nothing of this run was committed: rerun it")
        log.info("%s: another writer committed version %d first; committing on it", self.what, latest.version)
        self.base = latest
        return None

    # -- what stopped jobs left ---------------------------------------------------------------
    def _clean_stale(self) -> None:
        """Delete the prefixes of jobs older than :data:`STALE_S`, and the files they had moved
        into the table when they never committed them."""
        now = time.time()
        committed, doomed = None, []
        for d in list_dirs(self.final.child(JOBS_DIR)):
            age = _age(d, now)
            if d.name == self.job_id or age is None or age < STALE_S:
                continue
            if committed is None:        # a job stopped after its log entry: its files are the table's
                committed = {rec.get("job") for _, rec in deltalog.commits(self.final)}
            raw = read_bytes_if_exists(d.child(MOVING))
            doomed.append((d, [] if d.name in committed or not raw else _moved_names(self.final, d, raw)))
        for d, files in doomed:          # every name checked before anything is deleted
            for f in files:
                delete_file(f)
            delete_tree(d)
            log.info("%s: deleted what a stopped job left (%s)", self.final, d.name)


def _moved_names(final: Location, d: Location, raw: bytes) -> list[Location]:
    """The files a stopped job ``d`` had moved into the table, from its ``_moving.json``: each
    inside the table (:func:`~pipeline.fs.confined`) and named as that job names its files
    (``...-<job>.parquet``), or one line and nothing is deleted."""
    source = d.child(MOVING)
    try:
        names = json.loads(raw)
    except ValueError:
        names = None
    if not isinstance(names, list):
        raise BadInputError(f"{source}: not a list of names; nothing was deleted: remove {d} yourself")
    out = []
    for n in names:
        loc = confined(final, n, source)
        m = _MOVED.search(n)
        if not m or m.group(1) != d.name:
            raise BadInputError(f"{source}: names {n!r}, not a file that job writes; nothing was deleted: "
                                f"remove {d} yourself")
        out.append(loc)
    return out


def footer_schema(loc: Location):
    """The Arrow schema of one Parquet file (its footer), metadata dropped."""
    import pyarrow.parquet as pq

    with loc.filesystem().open_input_file(loc.path) as f:
        return pq.read_schema(f).remove_metadata()


def _sizes(files: list) -> dict[str, int]:
    """The bytes of each file (one metadata request per file on S3)."""
    if not files:
        return {}
    infos = files[0].filesystem().get_file_info([f.path for f in files])
    return {i.path: int(i.size) for i in infos}


def partition_dir(column: str, value) -> str:
    """The folder of a partition value (Hive style, the value URL-quoted)."""
    return f"{column}={quote(str(value), safe='')}"


def _dir_values(rel: str) -> dict:
    """The ``<column>=<value>`` folders of a file name, as partition values."""
    from urllib.parse import unquote

    return {k: unquote(v) for k, _, v in (d.partition("=") for d in posixpath.dirname(rel).split("/") if "=" in d)}


def _age(d: Location, now: float) -> Optional[float]:
    """Seconds since the newest file under the job prefix ``d`` was written."""
    import pyarrow.fs as pafs

    try:
        infos = d.filesystem().get_file_info(pafs.FileSelector(d.path, recursive=True, allow_not_found=True))
    except OSError:
        return None
    times = [i.mtime.timestamp() for i in infos if i.mtime is not None]
    return now - max(times) if times else None


def stale_jobs(final: Location, own: str) -> list[Location]:
    """The job prefixes under ``final/_pipeline/jobs/`` that are ours (named as a job id) and
    older than :data:`STALE_S`."""
    now = time.time()
    out = []
    for d in list_dirs(final.child(JOBS_DIR)):
        if d.name == own or not _JOB_ID.fullmatch(d.name):
            continue
        age = _age(d, now)
        if age is not None and age >= STALE_S:
            out.append(d)
    return out


_JOB_ID = re.compile(r"[0-9a-f]{12}")


def delta_job(final, **options) -> contextlib.AbstractContextManager[DeltaJob]:
    """Begin a job writing the Delta table ``final``; commit when the block ends, abort on any exception."""
    return committing(DeltaJob(final, **options).begin())
