"""The completion marker of a committed output, and what it proves.

Every commit (:mod:`pipeline.commit`) writes ``_COMPLETE`` into the output last, on a local disk
and on an object store alike::

    {"format": 2, "job": "3f0c...", "files": ["_report.json", "part-00000.parquet", ...],
     "objects": {"part-00000.parquet": "../.events.tmp-3f0c.../_attempts/s1-p0-a0-t4/part-00000.parquet"}}

``files`` are the output's files by their names in it. ``objects`` is there only while a commit on an
object store is under way: it maps a name to where its bytes lie, relative to the output
(the job's staging prefix, until the files are copied under their own names). Readers resolve
every name through the marker (:func:`Marker.where`), so an output is either the old one or the
new one, whatever step a commit stopped at.

The marker is also the proof that a location is ours to replace or delete (:func:`foreign_file`):
an output may be replaced when it is absent, empty, or a committed output of this pipeline (its
``_COMPLETE``, or the ``_report.json`` an ingestion wrote before outputs carried ``_COMPLETE``).
"""
from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from typing import Optional

from .errors import BadInputError
from .fs import Location, confined, list_entries, list_files, read_bytes_if_exists

COMPLETE_MARKER = "_COMPLETE"
#: the markers of outputs written before every output carried ``_COMPLETE`` (the ingestion's report)
LEGACY_MARKERS = ("_report.json",)
#: where task attempts write inside a job's staging prefix
ATTEMPTS = "_attempts"
FORMAT = 2
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<job>[0-9a-f]{12})$")


@dataclass(frozen=True)
class Marker:
    """A parsed ``_COMPLETE``: the job that committed the output and its files."""

    job: str
    files: tuple = ()
    objects: dict = field(default_factory=dict)

    def where(self, root: Location, name: str) -> Location:
        """Where the bytes of the output's file ``name`` lie (``root``: the output): inside the
        output, or, for a name of ``objects``, inside this job's staging prefix beside it
        (:func:`pipeline.fs.confined`: any other place is one line and nothing is read)."""
        source = root.child(COMPLETE_MARKER)
        rel = self.objects.get(name)
        if rel is None:
            return confined(root, name, source)
        staging = f"../{staging_name(root, self.job)}/"
        if self.job and not root.is_bucket_root and rel.startswith(staging):
            return confined(root.sibling(staging_name(root, self.job)), rel[len(staging):], source)
        return confined(root, rel, source)

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, "job": self.job, "files": sorted(self.files)}
        if self.objects:
            body["objects"] = dict(sorted(self.objects.items()))
        return json.dumps(body).encode()


def parse_marker(raw: bytes, at: Location) -> Marker:
    """The marker in ``raw`` (read from ``at``); one line naming ``at`` when it is not one."""
    try:
        body = json.loads(raw)
        files = tuple(str(f) for f in body["files"])
        objects = {str(k): str(v) for k, v in (body.get("objects") or {}).items()}
        marker = Marker(str(body.get("job", "")), files, objects)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BadInputError(f"{at}: not a valid completion marker") from None
    root = parent(at)
    for name in (*files, *objects):          # every name inside the output, before any is read
        marker.where(root, name)
    return marker


def read_marker(root: Location) -> Optional[Marker]:
    """The marker of the output ``root``; None when it has none."""
    raw = read_bytes_if_exists(root.child(COMPLETE_MARKER))
    return None if raw is None else parse_marker(raw, root.child(COMPLETE_MARKER))


def parent(loc: Location) -> Location:
    return Location(loc.scheme, posixpath.dirname(loc.path.rstrip("/")))


def staging_name(final: Location, job: str) -> str:
    """The job-scoped prefix beside ``final`` that a job writes into before its commit."""
    return f".{final.name}.tmp-{job}"


def old_name(final: Location, job: str) -> str:
    """Where a local commit that cannot exchange two directories moves the previous output."""
    return f".{final.name}.old-{job}"


def job_siblings(final: Location, kind: str) -> list[tuple[str, Location]]:
    """``(job, location)`` of the ``tmp`` (staging) or ``old`` directories of jobs beside ``final``."""
    if final.is_bucket_root:
        return []
    out = []
    for loc, _ in list_entries(parent(final)):
        m = _SIBLING.match(loc.name)
        if m and m.group("name") == final.name and m.group("kind") == kind:
            out.append((m.group("job"), loc))
    return out


def _relative_files(root: Location) -> list[str]:
    if root.is_local:
        if os.path.lexists(root.path) and not os.path.isdir(root.path):
            return ["."]
        names = []
        for d, dirs, files in os.walk(root.path):
            dirs.sort()
            names.extend(posixpath.relpath(os.path.join(d, f), root.path) for f in sorted(files))
        return names
    return [posixpath.relpath(f.path, root.path.rstrip("/")) for f in list_files(root)]


def foreign_file(final: Location) -> Optional[str]:
    """The first file under ``final`` when ``final`` is not ours to replace: None when it is
    absent, empty, or a committed output of ours (its ``_COMPLETE``, or a :data:`LEGACY_MARKERS`
    file: the whole folder is ours, files put into it since included); ``"."`` when ``final`` is a
    file itself."""
    if (not final.is_local or os.path.isdir(final.path)) and read_marker(final) is not None:
        return None                              # (a damaged marker is one line naming it)
    names = _relative_files(final)
    if not names or names == ["."]:
        return names[0] if names else None
    if any(m in names for m in LEGACY_MARKERS):
        return None
    return names[0]


def refuse_foreign(final: Location) -> None:
    """One line naming ``final`` and its first file that is not ours, unless it is ours to replace."""
    first = foreign_file(final)
    if first == ".":
        raise BadInputError(f"{final}: is a file, not an output directory of this pipeline; nothing was changed")
    if first is not None:
        raise BadInputError(f"{final}: not an output of this pipeline (it holds {first}, which no {COMPLETE_MARKER} "
                            "marker of ours lists): choose another output or remove it yourself; nothing was changed")
