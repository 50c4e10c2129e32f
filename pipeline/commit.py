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
* **The commit** keeps exactly the added files (and the small files the driver wrote into the
  prefix itself, :meth:`OutputJob.write_bytes` ...) and deletes the rest: losing, failed and
  killed attempts and the job's work files. Local paths: the kept files are renamed to their names
  inside the prefix, which is then renamed into place (the old output moved aside first).
  Object stores: the previous output's marker, then its objects, are deleted, the kept files are
  moved into place (server-side copies) and ``_COMPLETE`` is written last, listing them; readers
  trust that list (:func:`pipeline.committed.committed_files`), so an object a zombie attempt
  leaves behind is never read. Any failure before the commit deletes the prefix and leaves the
  previous output as it was.

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

Fault drills: with ``PIPELINE_TEST_FAULT=<when>:<how>[:<partition>]`` in the executors'
environment, or the same value in the job's local property ``pipeline.test.fault``
(``SparkContext.setLocalProperty``), the first attempt (attempt number 0) of every task (or of that
partition only) fails while writing its first file: ``when`` is ``mid`` (half of the file is
written and closed, then the fault) or ``after`` (the whole file, then the fault); ``how`` is
``exit`` (the Python worker dies: ``os._exit``) or ``raise`` (:class:`InjectedFault`). The tests
use it in a session that retries tasks (``spark.task.maxFailures`` > 1).
"""
from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from .errors import BadInputError, PipelineError
from .fs import Location, check_writable, delete_tree, error_reason, exists, location, write_bytes

COMPLETE_MARKER = "_COMPLETE"
ATTEMPTS = "_attempts"
#: the two fields every task result row carries for the commit (Spark DDL)
ATTEMPT_DDL = "attempt_dir string, files array<string>"
FAULT_ENV = "PIPELINE_TEST_FAULT"
FAULT_PROPERTY = "pipeline.test.fault"
_ATTEMPT_DIR = re.compile(r"^_attempts/s(-?\d+)-p(\d+)-a(\d+)-t(-?\d+)$")
_MOVE_THREADS = 8


def json_bytes(obj: Any) -> bytes:
    """How the pipeline writes a JSON file: indented, one trailing newline."""
    return (json.dumps(obj, indent=2, default=str) + "\n").encode()


class InjectedFault(RuntimeError):
    """The failure of a fault drill (:data:`FAULT_ENV`)."""


def attempt_fields() -> list:
    """The pyarrow fields of :data:`ATTEMPT_DDL`, to append to a task's result schema."""
    import pyarrow as pa

    return [pa.field("attempt_dir", pa.string()), pa.field("files", pa.list_(pa.string()))]


def attempt_schema(*fields) -> Any:
    """A pyarrow schema of the task's own result ``fields`` ((name, type) pairs or fields)
    followed by :func:`attempt_fields`."""
    import pyarrow as pa

    return pa.schema([*fields, *attempt_fields()])


# --------------------------------------------------------------------------------------------
# the task side
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobTarget:
    """What a task needs to write into a job (picklable): the job-scoped prefix."""

    staging: str

    @property
    def location(self) -> Location:
        return location(self.staging, output=True)

    def attempt(self, *, stage: Optional[int] = None, partition: Optional[int] = None,
                attempt: Optional[int] = None, task_attempt_id: Optional[int] = None) -> "TaskAttempt":
        """This task attempt, from Spark's ``TaskContext`` (the keywords override it). Outside a
        Spark task (a task body run by hand): stage -1, partition 0, attempt 0, task attempt id 0
        unless given."""
        from pyspark import TaskContext

        ctx = TaskContext.get()
        fault = os.environ.get(FAULT_ENV, "")
        if ctx is not None:
            fault = ctx.getLocalProperty(FAULT_PROPERTY) or fault
            stage = ctx.stageId() if stage is None else stage
            partition = ctx.partitionId() if partition is None else partition
            attempt = ctx.attemptNumber() if attempt is None else attempt
            task_attempt_id = ctx.taskAttemptId() if task_attempt_id is None else task_attempt_id
        stage, partition = (-1 if stage is None else stage), (0 if partition is None else partition)
        attempt, task_attempt_id = (0 if attempt is None else attempt), (0 if task_attempt_id is None else task_attempt_id)
        return TaskAttempt(self.staging, int(stage), int(partition), int(attempt), int(task_attempt_id), fault)

    def file(self, attempt_dir: str, rel: str) -> Location:
        """Where the file ``rel`` of the attempt ``attempt_dir`` lies (a later task reading the
        work file an earlier task wrote)."""
        return self.location.child(attempt_dir, rel)


@dataclass
class TaskAttempt:
    """One task attempt's writer: every file goes to ``<prefix>/<attempt_dir>/<rel>``; ``rel`` is
    the file's name in the committed output (``part-00003.parquet``, ``hlf/part-00003.parquet``)."""

    staging: str
    stage: int
    partition: int
    attempt: int
    task_attempt_id: int
    fault: str = ""
    _pending: list = field(default_factory=list)
    _written: int = 0

    @property
    def dir(self) -> str:
        return f"{ATTEMPTS}/s{self.stage}-p{self.partition}-a{self.attempt}-t{self.task_attempt_id}"

    def location(self, rel: str) -> Location:
        return location(self.staging, output=True).child(self.dir, _relative(rel))

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[Any]:
        """A pyarrow output stream for the file ``rel``; the file counts as written when the block
        ends without an error (a failed write removes what it left)."""
        loc = self.location(rel)
        fsys = loc.filesystem()
        if loc.is_local:
            os.makedirs(posixpath.dirname(loc.path), exist_ok=True)
        fault = self._fault()
        if fault and fault[0] == "mid":
            import pyarrow as pa

            buf = pa.BufferOutputStream()
            yield buf
            data = buf.getvalue().to_pybytes()
            with fsys.open_output_stream(loc.path) as out:
                out.write(data[: max(1, len(data) // 2)])
            self._fire(fault[1], rel)
        try:
            with fsys.open_output_stream(loc.path) as out:
                yield out
        except BaseException:
            with contextlib.suppress(OSError):
                fsys.delete_file(loc.path)
            raise
        self._pending.append(_relative(rel))
        self._written += 1
        if fault and fault[0] == "after":
            self._fire(fault[1], rel)

    def write_bytes(self, rel: str, data: bytes) -> int:
        with self.open(rel) as out:
            out.write(data)
        return len(data)

    def write_table(self, rel: str, table, **parquet_options) -> int:
        """``table`` as the Parquet file ``rel`` (``pyarrow.parquet.write_table`` options); its bytes."""
        import pyarrow.parquet as pq

        with self.open(rel) as out:
            pq.write_table(table, out, **parquet_options)
            size = out.tell()
        return size

    def parquet_writer(self, rel: str, schema, **parquet_options) -> "PartWriter":
        """The Parquet file ``rel`` written row group by row group (:class:`PartWriter`)."""
        return PartWriter(self, rel, schema, parquet_options)

    def put_file(self, rel: str, local: str | os.PathLike) -> int:
        """Copy a file of the task's local scratch space (e.g. one a library can only write to a
        seekable local file) to ``rel``; its bytes."""
        size = 0
        with open(local, "rb") as src, self.open(rel) as out:
            for piece in iter(lambda: src.read(1 << 22), b""):
                out.write(piece)
                size += len(piece)
        return size

    def discard(self, rel: str) -> None:
        """Remove a file this attempt wrote (e.g. the part of an input found bad later)."""
        rel = _relative(rel)
        loc = self.location(rel)
        with contextlib.suppress(OSError):
            loc.filesystem().delete_file(loc.path)
        if rel in self._pending:
            self._pending.remove(rel)

    def record(self) -> dict:
        """``{"attempt_dir", "files"}`` for a result row: the files written since the last record."""
        files, self._pending = self._pending, []
        return {"attempt_dir": self.dir, "files": files}

    def _fault(self) -> Optional[tuple[str, str]]:
        spec = self.fault
        if not spec or self.attempt != 0 or self._written:
            return None
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[0] not in ("mid", "after") or parts[1] not in ("exit", "raise"):
            raise ValueError(f"{FAULT_ENV} / {FAULT_PROPERTY} {spec!r}: expected mid|after:exit|raise[:partition]")
        if len(parts) == 3 and int(parts[2]) != self.partition:
            return None
        return parts[0], parts[1]

    def _fire(self, how: str, rel: str) -> None:
        if how == "exit":
            os._exit(17)
        raise InjectedFault(f"injected fault while writing {rel} (partition {self.partition}, attempt 0)")


class PartWriter:
    """A Parquet file a task attempt writes over several calls: ``writer`` is a
    ``pyarrow.parquet.ParquetWriter`` on the stream of :meth:`TaskAttempt.open`; :meth:`close`
    completes the file, :meth:`abort` removes what it left."""

    def __init__(self, attempt: TaskAttempt, rel: str, schema, parquet_options: dict) -> None:
        import pyarrow.parquet as pq

        self.rel = rel
        self._stream = attempt.open(rel)
        self.writer = pq.ParquetWriter(self._stream.__enter__(), schema, **parquet_options)

    def close(self) -> None:
        self.writer.close()
        self._stream.__exit__(None, None, None)

    def abort(self, exc: BaseException) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
        with contextlib.suppress(BaseException):
            self._stream.__exit__(type(exc), exc, exc.__traceback__)


def _relative(rel: str) -> str:
    """A file name relative to the output: no absolute path, no ``..``, no attempt directory."""
    norm = posixpath.normpath(str(rel).replace(os.sep, "/"))
    if norm.startswith(("/", "../")) or norm in (".", "..") or norm.split("/")[0] in (ATTEMPTS, COMPLETE_MARKER):
        raise ValueError(f"not a file name inside an output: {rel!r}")
    return norm


# --------------------------------------------------------------------------------------------
# the driver side
# --------------------------------------------------------------------------------------------

class OutputJob:
    """One output directory being written by a job: its prefix, the files kept, the commit."""

    def __init__(self, final: str | os.PathLike | Location, *, overwrite: bool = True) -> None:
        self.final = location(final, output=True)
        self.job_id = uuid.uuid4().hex[:12]
        self.staging = self.final.sibling(f".{self.final.name}.tmp-{self.job_id}")
        self.target = JobTarget(str(self.staging))
        self._kept: dict[str, str] = {}           # output name -> attempt dir ("" for the driver's files)
        self._tasks: dict[tuple[int, int], str] = {}
        self._overwrite = overwrite

    # -- life cycle -------------------------------------------------------------------------
    def begin(self) -> "OutputJob":
        if self.final.is_local:
            if os.path.exists(self.final.path) and not self._overwrite:
                raise BadInputError(f"output already exists: {self.final} (pass overwrite=true to replace it)")
            try:
                os.makedirs(self.staging.path)
            except OSError as e:
                raise BadInputError(f"{self.final}: cannot create the output: {e.strerror or e}") from None
            return self
        check_writable(self.final)
        if not self._overwrite and exists(self.final):
            raise BadInputError(f"output already exists: {self.final} (pass overwrite=true to replace it)")
        return self

    def abort(self) -> None:
        """Delete everything the job wrote; the previous output stays as it was."""
        delete_tree(self.staging)

    def commit(self) -> list[str]:
        """Publish the kept files under the final name; returns their names (sorted)."""
        files = sorted(self._kept)
        if self.final.is_local:
            self._commit_local()
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

    def kept(self) -> dict[str, Location]:
        """The files kept so far, by output name -> where they lie in the job's prefix now."""
        return {rel: self.staging.child(d, rel) if d else self.staging.child(rel) for rel, d in self._kept.items()}

    # -- commit -----------------------------------------------------------------------------
    def _commit_local(self) -> None:
        root = self.staging.path
        for rel, d in self._kept.items():
            if d:
                dest = os.path.join(root, rel)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.replace(os.path.join(root, d, rel), dest)
        shutil.rmtree(os.path.join(root, ATTEMPTS), ignore_errors=True)
        final, old = self.final.path, None
        if os.path.exists(final):
            old = self.final.sibling(f".{self.final.name}.old-{self.job_id}").path
            os.replace(final, old)
        os.replace(root, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        # a zombie attempt that recreated its directory inside the prefix before the rename
        shutil.rmtree(os.path.join(final, ATTEMPTS), ignore_errors=True)

    def _commit_object_store(self, files: list[str]) -> None:
        fsys = self.final.filesystem()
        marker = self.final.child(COMPLETE_MARKER)
        with contextlib.suppress(FileNotFoundError):
            fsys.delete_file(marker.path)          # no reader takes the old output for complete from here on
        delete_tree(self.final)
        moves = [(src.path, self.final.child(rel).path) for rel, src in self.kept().items()]
        with ThreadPoolExecutor(max_workers=_MOVE_THREADS) as pool:
            for fut in [pool.submit(fsys.move, s, d) for s, d in moves]:
                try:
                    fut.result()
                except OSError as e:
                    raise BadInputError(f"{self.final}: cannot write: {error_reason(e)}") from None
        write_bytes(marker, json.dumps({"files": files, "job": self.job_id}).encode())
        delete_tree(self.staging)


@contextlib.contextmanager
def output_job(final: str | os.PathLike | Location, *, overwrite: bool = True) -> Iterator[OutputJob]:
    """Begin a job writing ``final``; commit when the block ends, abort on any exception."""
    job = OutputJob(final, overwrite=overwrite).begin()
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
