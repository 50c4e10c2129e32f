"""Reading a committed output: whether a path is one (or lies inside one) and which data files it
holds. On an object store the ``_COMPLETE`` marker written last by :mod:`pipeline.commit` lists the
files, and only those are read; a local output is complete once it exists (the commit renames it
into place)."""
from __future__ import annotations

import json
import os
import posixpath
from typing import Optional

from .commit import COMPLETE_MARKER
from .errors import BadInputError
from .fs import Location, exists, list_files, location, read_bytes_if_exists



def _enclosing_marker(loc: Location) -> tuple[Optional[Location], Optional[bytes]]:
    """The committed output holding ``loc`` on an object store: ``loc`` itself or its nearest parent
    prefix with a ``_COMPLETE`` marker (a dataset inside a job's output, such as ``features/hlf``),
    and the marker's bytes; (None, None) when no prefix up to the bucket has one."""
    cur = loc
    while True:
        raw = read_bytes_if_exists(cur.child(COMPLETE_MARKER))
        if raw is not None or cur.is_bucket_root:
            return (cur, raw) if raw is not None else (None, None)
        cur = Location(cur.scheme, posixpath.dirname(cur.path.rstrip("/")))


def require_complete(path: str | os.PathLike | Location, what: str = "input") -> Location:
    """``path`` exists and, on an object store, is (or lies inside) a committed output: it or a
    parent prefix carries the completion marker."""
    loc = location(path)
    if loc.is_local:
        if not os.path.exists(loc.path):
            raise BadInputError(f"{what} not found: {loc}")
        if not os.access(loc.path, os.R_OK):
            raise BadInputError(f"{what} is not readable: {loc}")
        return loc
    if _enclosing_marker(loc)[0] is None:
        if exists(loc):
            raise BadInputError(f"{what} {loc} is incomplete (no {COMPLETE_MARKER} marker: "
                                "its writer failed or is still running)")
        raise BadInputError(f"{what} not found: {loc}")
    return loc


def committed_files(path: str | os.PathLike | Location, suffix: str = "", what: str = "input") -> list[Location]:
    """The data files of a committed output (or of a dataset inside one), sorted: on an object
    store those of the enclosing ``_COMPLETE`` marker's list under ``path`` (objects beside them are
    never read), on a local path the files under it; names with a component starting with ``_`` or
    ``.`` (reports, markers) are left out."""
    loc = location(path)
    if loc.is_local or loc.scheme != "s3":
        require_complete(loc, what)
        names = [posixpath.relpath(f.path, loc.path) for f in list_files(loc)]
    else:
        root, raw = _enclosing_marker(loc)
        if root is None:
            require_complete(loc, what)
        try:
            listed = list(json.loads(raw)["files"])
        except (ValueError, KeyError, TypeError):
            raise BadInputError(f"{root.child(COMPLETE_MARKER)}: not a valid completion marker") from None
        under = posixpath.relpath(loc.path.rstrip("/"), root.path.rstrip("/"))
        names = listed if under == "." else [n[len(under) + 1:] for n in listed if n.startswith(under + "/")]
    keep = [n for n in names if n.endswith(suffix) and not any(p.startswith(("_", ".")) for p in n.split("/"))]
    return [loc.child(n) for n in sorted(keep)]
