"""How an output directory written by many Spark tasks is committed.

Tasks write their files straight to the output's filesystem (a local path, a shared mount or
``s3://``, through :mod:`pipeline.fs`), never to the driver's disk; the driver publishes them in
one step. The pattern of Spark's output committers:

* **A job-scoped prefix.** :func:`output_job` checks the target (:func:`pipeline.fs.check_writable`)
  and creates ``<parent>/.<name>.tmp-<job>/`` beside the output. Everything the job writes goes
  there; the previous output is untouched until the commit.
* **Attempt-scoped names.** A task attempt (:meth:`JobTarget.attempt`, from Spark's
  ``TaskContext``) writes under ``_attempts/s<stage>-p<partition>-a<attempt>-t<task attempt
  id>/`` of that prefix, so a retried or speculative attempt never writes over another one's
  files, and a killed attempt's partial file stays in its own directory.
* **Results name the files.** Each task returns :meth:`TaskAttempt.record` (its attempt directory
  and the files it wrote, by their names in the output) with its result rows. Spark returns the
  results of one successful attempt per task; :meth:`OutputJob.add` takes those, refuses a second
  attempt of the same task or two tasks writing the same name.
* **What may be replaced.** :meth:`OutputJob.begin` refuses, in one line naming the first foreign
  file, an output location that is not absent, empty or a committed output of ours
  (:func:`pipeline.marker.refuse_foreign`), before any work.
* **The commit** keeps exactly the added files (and the small files the driver wrote into the
  prefix itself, :meth:`OutputJob.write_bytes` ...), lists them in ``_COMPLETE``
  (:mod:`pipeline.marker`) and never leaves a state in which neither the old nor the new output is
  complete: locally the prefix and the previous output are exchanged in one step
  (:meth:`OutputJob._commit_local`), on an object store no object is overwritten while a marker
  names it (:meth:`OutputJob._commit_object_store`). Readers trust the marker's list
  (:func:`pipeline.committed.committed_files`), so an object a zombie attempt leaves behind is never
  read. Any failure before the commit deletes the prefix and leaves the previous output as it was;
  what a stopped commit leaves beside the output is deleted by the next job on it.

Driver::

    with output_job(cfg.output) as job:
        body = functools.partial(write_partition, target=job.target)
        job.add(df.mapInArrow(spark_task(body), f"rows long, {ATTEMPT_DDL}").collect())
        job.write_json("_report.json", report)

Task::

    def write_partition(batches, *, target):
        attempt = target.attempt()
        for i, batch in enumerate(batches):
            attempt.write_table(f"part-{attempt.partition:05d}-{i:03d}.parquet", pa.Table.from_batches([batch]))
            yield pa.RecordBatch.from_pylist([{"rows": batch.num_rows, **attempt.record()}], attempt_schema(...))

The task side (a job's target, a task attempt's writer, the fault drills of task attempts) is
:mod:`pipeline.attempts`; this module re-exports it. Commit drills:
:data:`COMMIT_KILL_ENV` stops the driver after the n-th step of its commits.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import re
import shutil
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from .attempts import (ATTEMPT_DDL, FAULT_ENV, FAULT_PROPERTY, InjectedFault, JobTarget, PartWriter,
                       TaskAttempt, _relative, attempt_fields, attempt_schema)
from .errors import BadInputError, PipelineError
from .fs import (Location, check_writable, delete_file, delete_tree, error_reason, exists, list_files, location,
                 sync_dir, write_bytes)
from .marker import (ATTEMPTS, COMPLETE_MARKER, Marker, foreign_file, job_siblings, old_name, parent,
                     read_marker, refuse_foreign, staging_name)

__all__ = ["ATTEMPTS", "ATTEMPT_DDL", "COMMIT_KILL_ENV", "COMPLETE_MARKER", "FAULT_ENV", "FAULT_PROPERTY",
           "InjectedFault", "JobTarget", "OutputJob", "PartWriter", "TaskAttempt", "attempt_fields", "attempt_schema",
           "json_bytes", "output_job", "recover_local"]

#: commit drills: ``<n>`` stops this process (``os._exit(KILLED_EXIT)``) right after the n-th step of
#: its commits (each rename, move, copy, marker write or delete), so a test can stop a commit anywhere
COMMIT_KILL_ENV = "PIPELINE_TEST_COMMIT_KILL"
#: a local commit takes two renames instead of an atomic exchange (what filesystems without
#: ``RENAME_EXCHANGE`` get), for the drills of :func:`recover_local`
NO_EXCHANGE_ENV = "PIPELINE_TEST_NO_EXCHANGE"
KILLED_EXIT = 57
_ATTEMPT_DIR = re.compile(r"^_attempts/s(-?\d+)-p(\d+)-a(\d+)-t(-?\d+)$")
_MOVE_THREADS = 8


_steps_done = 0


def _step(what: str) -> None:
    """One step of a commit is done (:data:`COMMIT_KILL_ENV`)."""
    global _steps_done
    spec = os.environ.get(COMMIT_KILL_ENV)
    if not spec:
        return
    _steps_done += 1
    if _steps_done == int(spec):
        sys.stderr.write(f"[commit drill] stopped after step {_steps_done}: {what}\n")
        sys.stderr.flush()
        os._exit(KILLED_EXIT)


def json_bytes(obj: Any) -> bytes:
    """How the pipeline writes a JSON file: indented, one trailing newline."""
    return (json.dumps(obj, indent=2, default=str) + "\n").encode()


# --------------------------------------------------------------------------------------------
# the driver side
# --------------------------------------------------------------------------------------------

def _exchange(a: str, b: str) -> bool:
    """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the filesystem cannot (then the commit takes two renames, :func:`recover_local`)."""
    global _EXCHANGE_OK
    if not _EXCHANGE_OK or os.environ.get(NO_EXCHANGE_ENV):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        _EXCHANGE_OK = False
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:     # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), a)


_EXCHANGE_OK = True


def recover_local(final: Location) -> None:
    """Put back the previous local output where a commit that had to take two renames (no atomic
    exchange on this filesystem) stopped between them: ``final`` missing, ``.<name>.old-<job>``
    complete. Nothing to do otherwise."""
    if not final.is_local or os.path.lexists(final.path):
        return
    for _, old in job_siblings(final, "old"):
        if foreign_file(old) is None:
            with contextlib.suppress(FileNotFoundError):
                os.replace(old.path, final.path)
            return


class OutputJob:
    """One output directory being written by a job: its prefix, the files kept, the commit."""

    def __init__(self, final: str | os.PathLike | Location, *, overwrite: bool = True) -> None:
        self.final = location(final, output=True)
        if self.final.is_local and os.path.islink(self.final.path):
            # a link to the output directory: the directory is what is replaced, the link stays
            self.final = Location("file", os.path.realpath(self.final.path))
        self.job_id = uuid.uuid4().hex[:12]
        self.staging = self.final.sibling(staging_name(self.final, self.job_id))
        self.target = JobTarget(str(self.staging))
        self._kept: dict[str, str] = {}           # output name -> attempt dir ("" for the driver's files)
        self._tasks: dict[tuple[int, int], str] = {}
        self._overwrite = overwrite
        self._published = False                   # a marker names files in the job's prefix

    # -- life cycle -------------------------------------------------------------------------
    def begin(self) -> "OutputJob":
        """Check the target before any work: writable, and ours to replace (absent, empty, or a
        committed output of this pipeline); clean what earlier jobs left beside it."""
        if not self.final.is_local:
            check_writable(self.final)
        recover_local(self.final)
        if not self._overwrite and exists(self.final):
            raise BadInputError(f"output already exists: {self.final} (pass overwrite=true to replace it)")
        refuse_foreign(self.final)
        self._clean_leftovers()
        if self.final.is_local:
            try:
                os.makedirs(self.staging.path)
            except OSError as e:
                raise BadInputError(f"{self.final}: cannot create the output: {e.strerror or e}") from None
        return self

    def _clean_leftovers(self) -> None:
        """Delete the staging prefixes and set-aside outputs of earlier jobs on this output (a
        crashed or killed commit), except the staging prefix the current marker still reads from."""
        current = read_marker(self.final)
        keep = set()
        if current is not None:
            keep = {posixpath.normpath(current.where(self.final, n).path) for n in current.objects}
        for kind in ("tmp", "old"):
            for _, loc in job_siblings(self.final, kind):
                if not any(k == loc.path or k.startswith(loc.path.rstrip("/") + "/") for k in keep):
                    delete_tree(loc)
                    _step(f"cleaned {loc.name}")

    def abort(self) -> None:
        """Delete everything the job wrote; the previous output stays as it was. Once a commit on
        an object store has written the marker naming the job's prefix, the new output is the
        committed one: the prefix stays until the next job on this output cleans it."""
        if not self._published:
            delete_tree(self.staging)

    def commit(self) -> list[str]:
        """Publish the kept files under the final name; returns their names (sorted)."""
        files = sorted(self._kept)
        if self.final.is_local:
            self._commit_local(files)
        else:
            self._commit_object_store(files)
        return files
    # -- what is kept -----------------------------------------------------------------------
    def add(self, results: Iterable[Any]) -> None:
        """Keep the files of the task attempts in ``results`` (rows or dicts with ``attempt_dir``
        and ``files``, as Spark returned them: one successful attempt per task)."""
        for r in results:
            get = r.__getitem__
            attempt_dir, files = get("attempt_dir"), get("files") or []
            m = _ATTEMPT_DIR.match(attempt_dir or "")
            if not m:
                raise PipelineError(f"{self.final}: a task result without a valid attempt directory ({attempt_dir!r})")
            task = (int(m.group(1)), int(m.group(2)))
            seen = self._tasks.setdefault(task, attempt_dir)
            if seen != attempt_dir:
                raise PipelineError(f"{self.final}: two attempts of task {task} reported files ({seen}, {attempt_dir})")
            for rel in files:
                self._keep(_relative(rel), attempt_dir)

    def _keep(self, rel: str, attempt_dir: str) -> None:
        if rel in self._kept and self._kept[rel] != attempt_dir:
            raise PipelineError(f"{self.final}: {rel} was written twice (by {self._kept[rel] or 'the driver'} "
                                f"and {attempt_dir or 'the driver'})")
        self._kept[rel] = attempt_dir

    def write_bytes(self, rel: str, data: bytes) -> Location:
        """A small file written by the driver into the job (one PUT / a temporary file and a rename)."""
        rel = _relative(rel)
        loc = self.staging.child(rel)
        write_bytes(loc, data)
        self._keep(rel, "")
        return loc

    def write_json(self, rel: str, obj: Any) -> Location:
        return self.write_bytes(rel, json_bytes(obj))

    def write_table(self, rel: str, table, **parquet_options) -> int:
        """A Parquet file written by the driver (e.g. an empty part holding the schema); its bytes."""
        import pyarrow.parquet as pq

        rel = _relative(rel)
        loc = self.staging.child(rel)
        fsys = loc.filesystem()
        if loc.is_local:
            os.makedirs(posixpath.dirname(loc.path), exist_ok=True)
        try:
            with fsys.open_output_stream(loc.path) as out:
                pq.write_table(table, out, **parquet_options)
                size = out.tell()
        except BaseException:
            with contextlib.suppress(OSError):
                fsys.delete_file(loc.path)
            raise
        self._keep(rel, "")
        return size

    def upload(self, rel: str, local: str | os.PathLike) -> None:
        """A file of the driver's local disk copied into the job (a driver that stages a small
        output locally: :func:`pipeline.outputs.atomic_output_dir`)."""
        import pyarrow.fs as pafs

        rel = _relative(rel)
        loc = self.staging.child(rel)
        try:
            pafs.copy_files(os.fspath(local), loc.path, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=loc.filesystem())
        except OSError as e:
            raise BadInputError(f"{self.final.child(rel)}: cannot write: {error_reason(e)}") from None
        self._keep(rel, "")

    def adopt(self, rel: str) -> None:
        """Keep a file the driver wrote into the job's prefix itself (by its name in the output)."""
        self._keep(_relative(rel), "")

    def kept(self) -> dict[str, Location]:
        """The files kept so far, by output name -> where they lie in the job's prefix now."""
        return {rel: self.staging.child(d, rel) if d else self.staging.child(rel) for rel, d in self._kept.items()}

    # -- commit -----------------------------------------------------------------------------
    def _commit_local(self, files: list[str]) -> None:
        """Rename the kept files to their names inside the prefix, write the marker there, then
        exchange the prefix with the previous output in one step (or, where the filesystem cannot,
        move the previous output aside and the prefix into place: :func:`recover_local` undoes a
        stop between the two); the previous output is deleted last."""
        root = self.staging.path
        for rel, d in self._kept.items():
            if d:
                dest = os.path.join(root, rel)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.replace(os.path.join(root, d, rel), dest)
                _step(f"moved {rel}")
        shutil.rmtree(os.path.join(root, ATTEMPTS), ignore_errors=True)
        _step("removed the attempts")
        write_bytes(self.staging.child(COMPLETE_MARKER), Marker(self.job_id, tuple(files)).to_bytes())
        _step("wrote the marker")
        final = self.final.path
        if not os.path.lexists(final):
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(root, final)
            _step("renamed the output into place")
        elif _exchange(root, final):
            _step("exchanged the outputs")
            delete_tree(self.staging)                 # now the previous output
            _step("deleted the previous output")
        else:
            old = self.final.sibling(old_name(self.final, self.job_id)).path
            os.replace(final, old)
            _step("moved the previous output aside")
            os.replace(root, final)
            _step("renamed the output into place")
            shutil.rmtree(old, ignore_errors=True)
            _step("deleted the previous output")
        sync_dir(parent(self.final))
        # a zombie attempt that recreated its directory inside the prefix before the rename
        shutil.rmtree(os.path.join(final, ATTEMPTS), ignore_errors=True)

    def _commit_object_store(self, files: list[str]) -> None:
        """No object is overwritten while a marker names it: (1) a marker naming the new files
        where they lie in the job's prefix (the new output is complete from here on), (2) each
        file copied under its own name, (3) the marker naming them there, (4) every other object
        under the output deleted (the previous output's files, and anything put into it), (5) the
        job's prefix deleted. A stop at any step leaves the old or the new output complete; what
        is left is ours (under the output's marker, or a job's prefix) and the next job on this
        output deletes it."""
        fsys = self.final.filesystem()
        marker = self.final.child(COMPLETE_MARKER)
        previous = read_marker(self.final)
        kept = self.kept()
        present = {f.path for f in list_files(self.staging)}
        missing = sorted(rel for rel, src in kept.items() if src.path not in present)
        if missing:                 # checked before any marker names them: the old output stays as it is
            raise BadInputError(f"{self.final}: cannot commit: {missing[0]} is missing from the job's prefix")
        rel_to_final = {rel: posixpath.relpath(src.path, self.final.path.rstrip("/")) for rel, src in kept.items()}
        write_bytes(marker, Marker(self.job_id, tuple(files), rel_to_final).to_bytes())
        self._published = True
        _step("wrote the marker naming the job's prefix")
        with ThreadPoolExecutor(max_workers=_MOVE_THREADS) as pool:
            futs = [pool.submit(fsys.copy_file, src.path, self.final.child(rel).path) for rel, src in kept.items()]
            for (rel, _), fut in zip(kept.items(), futs):
                try:
                    fut.result()
                except OSError as e:
                    raise BadInputError(f"{self.final}: cannot write: {error_reason(e)}") from None
                _step(f"copied {rel}")
        write_bytes(marker, Marker(self.job_id, tuple(files)).to_bytes())
        _step("wrote the marker")
        keep = {self.final.child(n).path for n in (*files, COMPLETE_MARKER)}
        for f in list_files(self.final):
            if f.path not in keep:
                delete_file(f)
                _step(f"deleted {posixpath.relpath(f.path, self.final.path)}")
        if previous is not None and previous.objects:   # a previous job's prefix its stopped commit left named
            self._clean_leftovers()
        delete_tree(self.staging)
        _step("deleted the job's prefix")


@contextlib.contextmanager
def committing(job):
    """Yield the begun ``job``; commit it when the block ends, abort it on any exception, in the block
    or in the commit. Every kind of output job (``begin``, ``commit``, ``abort``) commits through it."""
    try:
        yield job
    except BaseException:
        job.abort()
        raise
    try:
        job.commit()
    except BaseException:
        job.abort()
        raise


def output_job(final: str | os.PathLike | Location, *,
               overwrite: bool = True) -> contextlib.AbstractContextManager[OutputJob]:
    """Begin a job writing ``final``; commit when the block ends, abort on any exception."""
    return committing(OutputJob(final, overwrite=overwrite).begin())
