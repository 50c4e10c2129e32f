"""Which input files a Delta table holds: the source ledger stored with each commit.

Every commit the pipeline makes to a table carries, in its commit metadata (``pipeline`` key,
:mod:`.deltalog`), the input files it ingested, each known by its path, size and modification time
(:func:`source_stat`), with the data files it produced and their entry ranges::

    {"job": "3f0c...", "stage": "ingest_root", "sources": [
        {"file": "/data/day2/a.root", "size": 1234, "mtime_ns": 1700000000000000000,
         "entries": 1000, "rows": 1000, "parts": [{"path": "part-f00000-c00000-3f0c....parquet",
         "rows": 1000, "entry_start": 0, "entry_stop": 1000}]}],
     "replaced": ["/data/day1/b.root"]}

The ledger of a version (:func:`read_ledger`) is every commit's sources up to it, a later commit of
a file replacing an earlier one. :func:`select_new` splits a run's inputs into new files, files the
table holds unchanged, and changed files (same path, another size or modification time).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from ..errors import BadInputError
from ..fs import Location, error_reason, location, sha256
from . import deltalog

log = logging.getLogger(__name__)

#: what a run does with an input file the table holds with another size or modification time
ChangedPolicy = Literal["skip", "replace", "fail"]
CHANGED_POLICIES = ("skip", "replace", "fail")


def source_stat(path: str, checksum: bool = False) -> dict:
    """What identifies the input ``path``: ``{"file", "size", "mtime_ns"}``, plus

    * ``real``: a local path's :func:`os.path.realpath`, where it differs from ``path`` (a symlink,
      a folder reached through one): the file is known by it (:func:`identity`);
    * ``etag``: an ``s3://`` object's ETag, from the HEAD request that gives its size and
      modification time (pyarrow's ``open_input_file``; its ``get_file_info`` has no ETag);
    * ``sha256``: the content's SHA-256 when ``checksum`` (``input_identity: checksum``), for
      stores where another content can have the same size and modification time (``cp -p``,
      ``touch -r``); it reads the whole file.

    ``root://`` and ``http(s)://``: what fsspec's ``info`` gives, else the path alone."""
    if "://" not in path or path.startswith(("s3://", "file://")):
        loc = location(path)
        out = _s3_head(path, loc) if loc.scheme == "s3" else None
        if out is None:
            out = _stat(path, loc)
        if loc.is_local and out["size"] is not None:
            real = os.path.realpath(loc.path)
            if real != path:
                out["real"] = real
        if checksum and out["size"] is not None:
            out["sha256"] = sha256(loc)
        return out
    try:
        import fsspec

        fs, _, (p,) = fsspec.get_fs_token_paths(path)
        info = fs.info(p)
        mt = info.get("mtime") or info.get("LastModified")
        return {"file": path, "size": info.get("size"), "mtime_ns": None if mt is None else int(float(mt) * 1e9),
                "etag": info.get("ETag") or info.get("etag")}
    except Exception:  # noqa: BLE001 - known by its path alone
        return {"file": path, "size": None, "mtime_ns": None}


def _stat(path: str, loc: Location) -> dict:
    import pyarrow.fs as pafs

    try:
        info = loc.filesystem().get_file_info(loc.path)
    except OSError as e:
        raise BadInputError(f"{path}: {error_reason(e)}") from None
    if info.type != pafs.FileType.File:
        return {"file": path, "size": None, "mtime_ns": None}
    return {"file": path, "size": int(info.size), "mtime_ns": None if info.mtime_ns is None else int(info.mtime_ns)}


def _s3_head(path: str, loc: Location) -> Optional[dict]:
    """Size, modification time (as pyarrow's ``get_file_info`` gives it: whole seconds) and ETag of
    an object, from one HEAD request; None when it is not an object (a prefix, missing: the caller
    stats it and reports it)."""
    import datetime as dt

    try:
        with loc.filesystem().open_input_file(loc.path) as f:
            meta = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in (f.metadata() or {}).items()}
    except OSError:
        return None
    try:
        size = int(meta["Content-Length"])
        when = dt.datetime.fromisoformat(meta["Last-Modified"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    out = {"file": path, "size": size, "mtime_ns": int(when.timestamp()) * 10 ** 9 + when.microsecond * 1000}
    if meta.get("ETag"):
        out["etag"] = meta["ETag"]
    return out


def identity(stat: dict) -> str:
    """The name an input is known by in the ledger: its real path (a symlink, a folder reached
    through one and the file itself are one input), else its path or URI."""
    return stat.get("real") or stat["file"]


def same_file(a: dict, b: dict) -> bool:
    """Two stats of one input describe the same bytes: the same size and modification time (where
    known), and the same ETag and SHA-256 where both stats have one (a ledger entry written before
    ``input_identity: checksum`` has no SHA-256)."""
    return (all(a.get(k) == b.get(k) for k in ("size", "mtime_ns") if a.get(k) is not None or b.get(k) is not None)
            and all(a[k] == b[k] for k in ("etag", "sha256") if a.get(k) is not None and b.get(k) is not None))


@dataclass
class Ledger:
    """The sources of a table at one version: path -> its latest commit's entry (with ``version``)."""

    version: Optional[int]
    sources: dict = field(default_factory=dict)

    def parts(self) -> dict:
        """data file path -> (source entry, part entry), for every part of every source."""
        return {p["path"]: (s, p) for s in self.sources.values() for p in s.get("parts") or []}


def read_ledger(loc: Location, version: Optional[int] = None) -> Ledger:
    """The ledger of the table ``loc`` at ``version`` (None: the newest); an empty one when
    ``loc`` holds no table."""
    if version is None and not deltalog.is_table(loc):
        return Ledger(None)
    entries = deltalog.commits(loc, version)
    led = Ledger(entries[-1][0] if entries else None)
    for v, rec in entries:
        if rec.get("overwrite"):
            led.sources.clear()
        for f in rec.get("replaced") or []:
            led.sources.pop(f, None)
        for s in rec.get("sources") or []:
            if not s.get("error"):
                led.sources[s["file"]] = {**s, "version": v}
    return led


@dataclass
class Selection:
    """A run's inputs split by the ledger: ``todo`` (read them), ``unchanged`` (held already),
    ``changed`` (held with another size or modification time; with ``replace`` also in ``todo``),
    ``replace`` (the table's data files of the changed files to remove), ``replaced`` (the ledger's
    names of the changed files replaced), ``duplicates`` (inputs that name a file another input of
    the run names: a symlink to it, the same real path)."""

    todo: list
    unchanged: list
    changed: list
    replace: list
    replaced: list = field(default_factory=list)
    duplicates: list = field(default_factory=list)


def select_new(files: list[str], stats: dict, ledger: Ledger, on_changed: ChangedPolicy, where: str) -> Selection:
    """Split ``files`` (their ``stats`` from :func:`source_stat`) by ``ledger``, each known by its
    :func:`identity`; one line per changed file and per input that names a file another input of
    the run names, and the run refused in one line when ``on_changed`` is ``fail``."""
    todo, unchanged, changed, replace, replaced, dups = [], [], [], [], [], []
    held_by = {identity(s): s for s in ledger.sources.values()}
    seen: dict[str, str] = {}
    for f in files:
        key = identity(stats[f])
        if key in seen:
            print(f"{f}: the same file as the input {seen[key]} ({key}): read once")
            dups.append(f)
            continue
        seen[key] = f
        held = held_by.get(key)
        if held is None:
            todo.append(f)
        elif same_file(held, stats[f]):
            unchanged.append(f)
        else:
            changed.append(f)
            what = (f"{f}: changed since the table ingested it at version {held['version']} (size {held.get('size')} "
                    f"-> {stats[f].get('size')}, mtime_ns {held.get('mtime_ns')} -> {stats[f].get('mtime_ns')}"
                    + "".join(f", {k} {held[k]} -> {stats[f][k]}" for k in ("etag", "sha256")
                              if held.get(k) is not None and stats[f].get(k) is not None and held[k] != stats[f][k])
                    + ")")
            if on_changed == "fail":
                raise BadInputError(f"{what}; on_changed: fail (use skip to keep its old rows, replace to "
                                    f"re-ingest it) in {where}")
            print(f"{what}: {'skipped, its old rows kept' if on_changed == 'skip' else 'its rows replaced'}")
            if on_changed == "replace":
                todo.append(f)
                replace.extend(p["path"] for p in held.get("parts") or [])
                replaced.append(held["file"])
    return Selection(todo, unchanged, changed, replace, replaced, dups)
