"""The task side of the commit protocol (:mod:`pipeline.commit`): a job's target, a task attempt's
writer with attempt-scoped names, and the fault drills of task attempts.

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
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from .fs import Location, location
from .marker import ATTEMPTS, COMPLETE_MARKER

#: the two fields every task result row carries for the commit (Spark DDL)
ATTEMPT_DDL = "attempt_dir string, files array<string>"
FAULT_ENV = "PIPELINE_TEST_FAULT"
FAULT_PROPERTY = "pipeline.test.fault"
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
