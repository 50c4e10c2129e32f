"""Atomic outputs, run-scoped paths and JSON files, on a local disk or an S3-compatible object store.

Every stage writes its output directory through :func:`atomic_output_dir`, so a failed run leaves
nothing partial behind and a rerun replaces its own output in one step:

* **Local paths** (and ``file://``): the stage writes into a temporary sibling directory, which is
  renamed into place when complete (a directory rename is atomic on a POSIX filesystem).
* **``s3://`` outputs**: object stores have no directory rename. The stage writes into a local
  staging directory; on success the files are uploaded under a temporary sibling prefix
  (``.<name>.tmp-<id>/``), the previous output under the final prefix is deleted, the new files are
  moved into place (server-side copies) and a completion marker ``_COMPLETE`` is written last.
  Readers check the marker (:func:`require_complete`): a prefix without it is an incomplete output
  and is refused. Any failure before the move removes the temporary prefix and leaves the previous
  output untouched; a failure during the move leaves the final prefix without its marker.

Paths are checked before any work starts (:func:`pipeline.fs.check_writable`): a URI scheme
nobody supports, missing credentials, a bucket that does not exist or a read-only prefix is one
line naming the URI and the reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

from .errors import BadInputError, ConfigError
from .fs import Location, check_writable, delete_tree, exists, location, move_tree, read_bytes, upload_tree, write_bytes

COMPLETE_MARKER = "_COMPLETE"


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
    loc = location(final, output=True)
    if loc.is_local:
        with _atomic_local(Path(loc.path), overwrite) as tmp:
            yield tmp
        return
    check_writable(loc)
    if not overwrite and exists(loc):
        raise BadInputError(f"output already exists: {loc} (pass overwrite=true to replace it)")
    staging = Path(tempfile.mkdtemp(prefix=f"pipeline-{loc.name}-"))
    try:
        yield staging
        _commit_remote(staging, loc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_staging(master: str, out: str | os.PathLike | Location, stage: str) -> None:
    """An object-store output of a Spark stage is staged in a local directory of the driver that the
    executors write into (:func:`atomic_output_dir`): that needs the executors on the driver's
    machine, i.e. a local master (``local[*]``, ``local-cluster[...]``). ConfigError otherwise, before
    any work. Local and shared-filesystem outputs pass on any master."""
    loc = out if isinstance(out, Location) else location(out, output=True)
    if not loc.is_local and not master.startswith("local"):
        raise ConfigError(f"output={loc}: the {stage} stage writes an object-store output through the driver's "
                          f"local staging directory, which the executors of spark.master={master} cannot reach; "
                          "write to a shared filesystem path instead (docs/storage.md)")


@contextlib.contextmanager
def _atomic_local(final: Path, overwrite: bool) -> Iterator[Path]:
    if final.exists() and not overwrite:
        raise BadInputError(f"output already exists: {final} (pass overwrite=true to replace it)")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as e:
        raise BadInputError(f"{final}: cannot create the output: {e.strerror or e}") from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _commit_remote(staging: Path, final: Location) -> None:
    tmp = final.sibling(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        files = upload_tree(staging, tmp)
    except BaseException:
        delete_tree(tmp)
        raise
    delete_tree(final)
    move_tree(tmp, final)
    delete_tree(tmp)
    write_bytes(final.child(COMPLETE_MARKER), json.dumps({"files": files}).encode())


def require_complete(path: str | os.PathLike, what: str = "input") -> Location:
    """``path`` exists and, on an object store, carries the completion marker of a committed output."""
    loc = location(path)
    if loc.is_local:
        require_exists(loc.path, what)
        return loc
    if not exists(loc.child(COMPLETE_MARKER)):
        if exists(loc):
            raise BadInputError(f"{what} {loc} is incomplete (no {COMPLETE_MARKER} marker: "
                                "its writer failed or is still running)")
        raise BadInputError(f"{what} not found: {loc}")
    return loc


def run_scoped(root: str | os.PathLike, run_id: str | None, *parts: str) -> Path:
    """``root/<run_id>/parts...``: where a scheduled run writes, so runs never collide."""
    base = local_path(root)
    if run_id:
        base = base / run_id
    return base.joinpath(*parts)


def write_json(path: str | os.PathLike, obj: Any) -> str | Path:
    """Write ``obj`` as JSON whole (a temporary file and a rename; one PUT on an object store)."""
    loc = location(path, output=True)
    write_bytes(loc, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())
    return Path(loc.path) if loc.is_local else str(loc)


def read_json(path: str | os.PathLike) -> Any:
    loc = location(path)
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
