"""Reading a committed output: whether a path is one (or lies inside one), which data files it
holds and where each of its files lies.

Every commit writes the ``_COMPLETE`` marker last (:mod:`pipeline.marker`), and readers take the
marker's list, never a listing: an object or file that anyone put under a committed output after
its commit is not read, and a commit stopped at any step leaves the marker naming the old or the
new output. On an object store the marker is required; a local directory without one (a dataset
a user wrote) is read by listing it.
"""
from __future__ import annotations

import os
import posixpath
from typing import Optional

from .commit import recover_local
from .errors import BadInputError
from .fs import Location, exists, list_files, location
from .marker import COMPLETE_MARKER, Marker, parent, read_marker


def _enclosing_marker(loc: Location) -> tuple[Optional[Location], Optional[Marker]]:
    """The committed output holding ``loc``: ``loc`` itself or its nearest parent with a
    ``_COMPLETE`` marker (a dataset inside a job's output, such as ``features/hlf``), and the
    marker; (None, None) when no parent up to the bucket or the filesystem root has one."""
    cur = loc
    while True:
        marker = read_marker(cur)
        if marker is not None:
            return cur, marker
        up = parent(cur)
        if cur.is_bucket_root or up.path in (cur.path, "", "/"):
            return None, None
        cur = up


def require_complete(path: str | os.PathLike | Location, what: str = "input") -> Location:
    """``path`` exists and, on an object store, is (or lies inside) a committed output: it or a
    parent prefix carries the completion marker. A local output that a commit left moved aside
    (a stop between its two renames) is put back first."""
    loc = location(path)
    if loc.is_local:
        recover_local(loc)
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


def _marker_names(loc: Location, root: Location, marker: Marker) -> list[str]:
    """The names of the marker's files under ``loc`` (relative to ``loc``)."""
    under = posixpath.relpath(loc.path.rstrip("/"), root.path.rstrip("/"))
    if under == ".":
        return list(marker.files)
    return [n[len(under) + 1:] for n in marker.files if n.startswith(under + "/")]


def committed_files(path: str | os.PathLike | Location, suffix: str = "", what: str = "input") -> list[Location]:
    """The data files of a committed output (or of a dataset inside one), sorted by name: the files
    of the enclosing ``_COMPLETE`` marker's list under ``path``, where they lie (objects beside them
    are never read); a local directory without a marker: the files under it. Names with a component
    starting with ``_`` or ``.`` (reports, markers) are left out."""
    loc = location(path)
    if loc.is_local:
        require_complete(loc, what)
    root, marker = _enclosing_marker(loc)          # one walk up to the marker, not a second one
    if marker is None:
        if not loc.is_local:
            require_complete(loc, what)            # no marker on the store: incomplete or not found
        names = [posixpath.relpath(f.path, loc.path) for f in list_files(loc)]
        where = {n: loc.child(n) for n in names}
    else:
        names = _marker_names(loc, root, marker)
        prefix = posixpath.relpath(loc.path.rstrip("/"), root.path.rstrip("/"))
        where = {n: marker.where(root, n if prefix == "." else f"{prefix}/{n}") for n in names}
    keep = [n for n in names if n.endswith(suffix) and not any(p.startswith(("_", ".")) for p in n.split("/"))]
    return [where[n] for n in sorted(keep)]


def resolve(path: str | os.PathLike | Location) -> Location:
    """Where the bytes of the file ``path`` of a committed output lie now (a commit on an object
    store names them in its job's prefix until it has copied them under their own names); ``path``
    itself when no marker says otherwise."""
    loc = location(path)
    if loc.is_local:
        recover_local(parent(loc))
        return loc
    root, marker = _enclosing_marker(parent(loc))
    if marker is None or not marker.objects:
        return loc
    return marker.where(root, posixpath.relpath(loc.path, root.path.rstrip("/")))
