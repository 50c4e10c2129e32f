"""Atomic output directories, run-scoped paths and JSON manifests.

Every stage writes into a temporary sibling directory and moves it into place only when
it is complete, so a failed run leaves no partial output and a rerun replaces its own
output in one step. (Local and mounted file systems; ``file://`` URIs are accepted.)
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

from .errors import BadInputError


def local_path(path: str | os.PathLike) -> Path:
    s = str(path)
    if s.startswith("file://"):
        s = s[len("file://"):]
    elif "://" in s:
        raise BadInputError(f"only local paths are supported for outputs here, got {s}")
    return Path(s).expanduser().absolute()


def uri(path: str | os.PathLike) -> str:
    """A ``file://`` URI for Spark/Petastorm."""
    return "file://" + str(local_path(path))


@contextlib.contextmanager
def atomic_output_dir(final: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``final`` atomically.

    On any exception the temporary directory is removed and ``final`` is untouched.
    """
    final = local_path(final)
    if final.exists() and not overwrite:
        raise BadInputError(f"output already exists: {final} (pass overwrite=true to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
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


def run_scoped(root: str | os.PathLike, run_id: str | None, *parts: str) -> Path:
    """``root/<run_id>/parts...``: where a scheduled run writes, so runs never collide."""
    base = local_path(root)
    if run_id:
        base = base / run_id
    return base.joinpath(*parts)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, p)
    return p


def read_json(path: str | os.PathLike) -> Any:
    p = local_path(path)
    if not p.is_file():
        raise BadInputError(f"file not found: {p}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise BadInputError(f"{p} is not valid JSON: {e}") from None


def require_exists(path: str | os.PathLike, what: str = "input path") -> Path:
    p = local_path(path)
    if not p.exists():
        raise BadInputError(f"{what} not found: {p}")
    if not os.access(p, os.R_OK):
        raise BadInputError(f"{what} is not readable: {p}")
    return p
