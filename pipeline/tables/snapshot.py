"""Reading a Delta table as the stages and ``spark.read`` users do: the data files its snapshot
names, never a listing of its folder.

A table's folder holds more than its current rows: files a replaced input's rows were in (removed
in the log, kept on disk for time travel until ``vacuum``), and files a stopped job had moved in
without committing them. A plain Parquet reader of the folder (``spark.read.parquet(folder)``,
``pyarrow.dataset``) reads them all. :func:`snapshot_files` gives exactly the files of one version
(the newest, or ``version``: time travel); ``spark.read.parquet(*snapshot_files(table))`` reads
that version with Spark's own reader (the data columns: partition columns live in the log and in
the folder names, so add ``.option("basePath", table)`` for them).
"""
from __future__ import annotations

import os
import posixpath
from typing import Optional

from ..errors import BadInputError
from ..fs import Location, confined, is_dir, location
from . import deltalog
from .ledger import Ledger, read_ledger


def is_delta_table(path: str | os.PathLike | Location) -> bool:
    """``path`` holds a Delta table (its ``_delta_log/`` folder; one metadata request on S3)."""
    try:
        loc = location(path)
    except BadInputError:
        return False
    if loc.scheme not in ("file", "s3"):
        return False
    if loc.is_local:
        return os.path.isdir(os.path.join(loc.path, deltalog.DELTA_LOG))
    try:
        return is_dir(loc.child(deltalog.DELTA_LOG))
    except BadInputError:
        return False


def snapshot(path: str | os.PathLike | Location, version: Optional[int] = None) -> deltalog.Snapshot:
    return deltalog.snapshot(location(path), version)


def snapshot_files(path: str | os.PathLike | Location, version: Optional[int] = None) -> list[str]:
    """The URIs of the data files of the table ``path`` at ``version`` (None: the newest), sorted;
    each inside the table (:func:`~pipeline.fs.confined`: a log naming a file elsewhere is one line)."""
    loc = location(path)
    return [str(confined(loc, f.path, loc.child(deltalog.DELTA_LOG))) for f in deltalog.snapshot(loc, version).files]


def check_one_run(path: str | os.PathLike | Location) -> None:
    """The newest version of the table ``path`` and of the tables written with it (a feature
    stage's ``hlf/`` and ``llf/``: its log record's ``tables``, beside it) are one run's; one line
    naming each table's version when a run stopped between their commits (the files beside them,
    ``scaling.json``, are then an older run's). Tables without such a record pass."""
    from .tables_job import torn_tables

    loc = location(path)
    recs = deltalog.commits(loc)
    rec = max(recs, key=lambda r: r[0])[1] if recs else {}
    tables = rec.get("tables")
    if not rec.get("tables_job") or not isinstance(tables, list) or loc.is_bucket_root:
        return
    torn = torn_tables(Location(loc.scheme, posixpath.dirname(loc.path.rstrip("/"))), tuple(tables))
    if torn:
        raise BadInputError(f"{torn}: rerun the stage that wrote them (it replaces them all), or read one "
                            "version (input_version)")


def ledger(path: str | os.PathLike | Location, version: Optional[int] = None) -> Ledger:
    """The source ledger of the table ``path`` at ``version`` (:mod:`.ledger`)."""
    return read_ledger(location(path), version)
