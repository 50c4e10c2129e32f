"""Atomic outputs written by the driver, run-scoped paths and JSON files, on a local disk or an
S3-compatible object store.

Spark stages, whose tasks write the output, use the commit protocol of :mod:`pipeline.commit`
(a job-scoped prefix on the output's filesystem, attempt-scoped names, one commit by the driver).
:func:`atomic_output_dir` is the same commit for an output the driver writes alone with plain
file I/O (training summaries, published study runs): it yields a local directory, and

* **local paths** (and ``file://``): that directory is the job's prefix beside the output
  (``.<name>.tmp-<id>``), renamed into place when the block ends;
* **``s3://`` outputs**: a local staging directory whose files are uploaded into the job's prefix
  and committed with the ``_COMPLETE`` marker (:class:`pipeline.commit.OutputJob`).

On any exception nothing is left behind and the previous output is untouched. Paths are checked
before any work starts (:func:`pipeline.fs.check_writable`): a URI scheme nobody supports,
missing credentials, a bucket that does not exist or a read-only prefix is one line naming the
URI and the reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .commit import COMPLETE_MARKER, OutputJob, json_bytes
from .committed import require_complete, resolve
from .errors import BadInputError
from .fs import location, read_bytes, write_bytes

__all__ = ["COMPLETE_MARKER", "atomic_output_dir", "local_path", "read_json", "require_complete", "require_exists",
           "run_scoped", "uri", "write_json"]


def local_path(path: str | os.PathLike) -> Path:
    """The local path of ``path`` (a path or ``file://`` URI); a remote URI is one clear error."""
    loc = location(path)
    if not loc.is_local:
        raise BadInputError(f"{loc}: this step reads and writes local paths only")
    return Path(loc.path)


def uri(path: str | os.PathLike) -> str:
    """The URI Spark and Petastorm read (``file:///...`` or ``s3a://...``)."""
    return location(path).spark_uri()


@contextlib.contextmanager
def atomic_output_dir(final: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a local directory to write into; on success it becomes ``final`` atomically.

    On any exception nothing is left behind and ``final`` is untouched.
    """
    job = OutputJob(final, overwrite=overwrite).begin()
    staging = Path(job.staging.path) if job.final.is_local else Path(tempfile.mkdtemp(prefix=f"pipeline-{job.final.name}-"))
    try:
        yield staging
        for f in sorted(p for p in staging.rglob("*") if p.is_file()):
            rel = f.relative_to(staging).as_posix()
            if job.final.is_local:
                job.adopt(rel)                 # written in the prefix itself: listed by the marker
            else:
                job.upload(rel, f)
        job.commit()
    except BaseException:
        job.abort()
        raise
    finally:
        if not job.final.is_local:
            shutil.rmtree(staging, ignore_errors=True)


def run_scoped(root: str | os.PathLike, run_id: str | None, *parts: str) -> Path:
    """``root/<run_id>/parts...``: where a scheduled run writes, so runs never collide."""
    base = local_path(root)
    if run_id:
        base = base / run_id
    return base.joinpath(*parts)


def write_json(path: str | os.PathLike, obj: Any) -> str | Path:
    """Write ``obj`` as JSON whole (a temporary file and a rename; one PUT on an object store)."""
    loc = location(path, output=True)
    write_bytes(loc, json_bytes(obj))
    return Path(loc.path) if loc.is_local else str(loc)


def read_json(path: str | os.PathLike) -> Any:
    loc = resolve(path)         # a file of a committed output: where its marker says it lies
    if loc.is_local and not Path(loc.path).is_file():
        raise BadInputError(f"file not found: {loc}")
    try:
        return json.loads(read_bytes(loc))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"{loc} is not valid JSON: {e}") from None


def require_exists(path: str | os.PathLike, what: str = "input path") -> Path:
    p = local_path(path)
    if not p.exists():
        raise BadInputError(f"{what} not found: {p}")
    if not os.access(p, os.R_OK):
        raise BadInputError(f"{what} is not readable: {p}")
    return p
