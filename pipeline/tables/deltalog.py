"""The one module that talks to ``deltalake`` (delta-rs): a table's snapshot, its commits, and a
commit of Parquet files the pipeline's tasks wrote.

Everything else in the pipeline goes through these functions, so a change in delta-rs's API is
one module's change (``tests/test_delta.py`` fails when it breaks):

* :func:`snapshot`: the files of a version (the newest, or an older one: time travel), with their
  sizes, partition values and row counts, the table's Arrow schema and partition columns; each
  file's name decoded from the log's percent-encoded path (:func:`file_name`, the one place that
  decodes: a partition value with a space, ``=``, ``%`` or a non-ASCII letter);
* :func:`commits`: the custom metadata the pipeline stored with each commit (its source ledger),
  numbered from the newest version (delta-rs numbers a history down from the version it opened,
  although it lists every commit);
* :func:`commit`: one log entry adding (and removing) files, with custom metadata, that fails
  with :class:`CommitConflict` instead of retrying when another writer committed first
  (``max_commit_retries=0``): the caller decides whether its commit still holds;
* :func:`add_columns`: new nullable columns (delta-rs's Python API commits a schema change on its
  own, not with an append).

On ``s3://`` delta-rs reads the same settings as :mod:`pipeline.fs` (``AWS_*``), passed as
storage options; a log entry is created with a conditional PUT (``If-None-Match``), so two
writers never both create version N (docs/ingestion.md#delta-tables).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import unquote

from ..errors import BadInputError
from ..fs import Location, s3_settings

#: the commit metadata key under which the pipeline stores its record of a commit
PIPELINE_KEY = "pipeline"
#: the log directory that makes a folder a Delta table
DELTA_LOG = "_delta_log"
#: table properties the pipeline sets when it creates a table: the commit entries hold the source
#: ledger (which input files the table holds), so they must outlive delta-rs's log clean-up
TABLE_CONFIGURATION = {"delta.enableExpiredLogCleanup": "false"}
#: commit drills: a log entry whose outcome the writer cannot see. ``retry``: the entry is written,
#: then written again (a reply lost on the way, the client's retry answered 412 by the store's
#: conditional PUT: a :class:`CommitConflict`); ``raise``: written, then an error (a reply lost, no
#: retry); ``exit``: written, then :class:`SystemExit` (the process told to stop in between)
LOG_FAULT_ENV = "PIPELINE_TEST_LOG_FAULT"
LOG_FAULTS = ("retry", "raise", "exit")


class CommitConflict(Exception):
    """Another writer committed a version after the one this commit was prepared on."""


class NoTable(BadInputError):
    """The location holds no Delta table (no ``_delta_log/`` with a commit)."""


@dataclass(frozen=True)
class DataFile:
    """One data file of a snapshot: its path relative to the table, bytes, partition values, rows
    (None when the log has no count)."""

    path: str
    size: int
    partition_values: dict = field(default_factory=dict)
    rows: Optional[int] = None


@dataclass(frozen=True)
class Snapshot:
    """One version of a table: its data files, Arrow schema and partition columns."""

    version: int
    files: tuple
    schema: Any
    partition_by: tuple = ()
    configuration: dict = field(default_factory=dict)


def table_uri(loc: Location) -> str:
    return loc.path if loc.is_local else f"s3://{loc.path.rstrip('/')}"


def storage_options(loc: Location) -> Optional[dict]:
    """delta-rs's storage options for ``loc`` (the S3 settings of :func:`pipeline.fs.s3_settings`)."""
    if loc.is_local:
        return None
    s = s3_settings()
    if not (s["key"] and s["secret"]):
        raise BadInputError(f"{loc}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                            "(and AWS_ENDPOINT_URL for a store other than AWS)")
    opts = {"AWS_ACCESS_KEY_ID": s["key"], "AWS_SECRET_ACCESS_KEY": s["secret"], "AWS_REGION": s["region"]}
    if s["token"]:
        opts["AWS_SESSION_TOKEN"] = s["token"]
    if s["endpoint"]:
        opts["AWS_ENDPOINT_URL"] = s["endpoint"]
        if s["endpoint"].startswith("http://"):
            opts["AWS_ALLOW_HTTP"] = "true"
    return opts


def _open(loc: Location, version: Optional[int] = None):
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return DeltaTable(table_uri(loc), version=version, storage_options=storage_options(loc))
    except TableNotFoundError:
        raise NoTable(f"{loc}: not a Delta table (no {DELTA_LOG}/)") from None
    except Exception as e:  # noqa: BLE001 - delta-rs raises DeltaError / OSError / ValueError
        msg = " ".join(str(e).split())
        if version is not None and "version" in msg.lower():
            raise BadInputError(f"{loc}: no version {version} of this Delta table ({msg[:160]})") from None
        raise BadInputError(f"{loc}: cannot read the Delta table: {msg[:200]}") from None


def is_table(loc: Location) -> bool:
    """``loc`` holds a Delta table (a ``_delta_log`` with at least one commit)."""
    from deltalake import DeltaTable

    try:
        return bool(DeltaTable.is_deltatable(table_uri(loc), storage_options=storage_options(loc)))
    except BadInputError:
        raise
    except Exception:  # noqa: BLE001 - unreachable or not a table: not one
        return False


def snapshot(loc: Location, version: Optional[int] = None) -> Snapshot:
    """The files, schema and partition columns of the table ``loc`` at ``version`` (None: the newest)."""
    import pyarrow as pa

    dt = _open(loc, version)
    parts = tuple(dt.metadata().partition_columns)
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    files = []
    for a in actions:
        pv = {c: a.get(f"partition.{c}") for c in parts}
        pv = {c: (None if v is None else str(v)) for c, v in pv.items()}
        files.append(DataFile(file_name(a["path"]), int(a["size_bytes"]), pv,
                              None if a.get("num_records") is None else int(a["num_records"])))
    files.sort(key=lambda f: f.path)
    return Snapshot(int(dt.version()), tuple(files), pa.schema(dt.schema().to_arrow()), parts,
                    dict(dt.metadata().configuration or {}))


def file_name(log_path: str) -> str:
    """A data file's name relative to the table, from its path in the Delta log: the log stores a
    URI reference, percent-encoded (the folder ``sample=ttbar%202024`` is ``sample=ttbar%25202024``
    there); delta-rs encodes the names it is given when it writes (adds and removes alike) and
    returns the log's paths as they are when it reads."""
    return unquote(log_path)


def commits(loc: Location, up_to: Optional[int] = None) -> list[tuple[int, dict]]:
    """``(version, the pipeline's commit record)`` of every commit up to ``up_to`` (None: all), oldest
    first; commits the pipeline did not make have an empty record. The history is read from the
    newest version: delta-rs lists every commit whichever version it opened, and numbers them down
    from the opened one."""
    dt = _open(loc)
    newest = int(dt.version())
    if up_to is not None and up_to > newest:
        raise BadInputError(f"{loc}: no version {up_to} of this Delta table (the newest is {newest})")
    out = []
    for h in dt.history():
        v = int(h.get("version", -1))
        if up_to is None or v <= up_to:
            rec = h.get(PIPELINE_KEY)
            if isinstance(rec, str):
                rec = json.loads(rec)
            out.append((v, rec if isinstance(rec, dict) else {}))
    return sorted(out, key=lambda x: x[0])


def normalized(schema):
    """``schema`` as a Delta table's schema reads back (delta-rs's names and types for lists,
    strings ...), so that a run's schema and a table's compare column by column."""
    import pyarrow as pa
    from deltalake import Schema

    return pa.schema(Schema.from_arrow(schema).to_arrow())


def _add_actions(adds: list[dict]):
    from deltalake.transaction import AddAction

    now = int(time.time() * 1000)
    return [AddAction(a["path"], int(a["size"]), dict(a.get("partition_values") or {}), now, True,
                      json.dumps({"numRecords": int(a["rows"])}) if a.get("rows") is not None else None)
            for a in adds]


def commit(loc: Location, read_version: Optional[int], adds: list[dict], removes: list[str], schema,
           partition_by: list[str], record: dict) -> int:
    """One log entry adding ``adds`` (``{"path", "size", "partition_values", "rows"}``, paths
    relative to the table) and removing ``removes`` (paths), with ``record`` as the pipeline's
    commit metadata; ``read_version`` is the version the commit was prepared on (None: the table
    does not exist yet, this commit creates it). Returns the new version. :class:`CommitConflict`
    when another writer committed first (nothing of this commit is in the log then)."""
    from deltalake import Schema
    from deltalake.exceptions import CommitFailedError
    from deltalake.transaction import CommitProperties, RemoveAction, create_table_with_add_actions

    props = CommitProperties(custom_metadata={PIPELINE_KEY: record}, max_commit_retries=0)
    opts = storage_options(loc)
    uri = table_uri(loc)

    def write() -> int:
        if read_version is None:
            create_table_with_add_actions(uri, Schema.from_arrow(schema), _add_actions(adds), mode="error",
                                          partition_by=list(partition_by) or None,
                                          configuration=TABLE_CONFIGURATION, storage_options=opts,
                                          commit_properties=props)
            return 0
        dt = _open(loc, read_version)
        now = int(time.time() * 1000)
        actions = [*_add_actions(adds), *(RemoveAction(path=p, deletion_timestamp=now, data_change=True)
                                          for p in removes)]
        dt.create_write_transaction(actions, "append", schema, partition_by=list(partition_by) or None,
                                    commit_properties=props)
        return read_version + 1

    try:
        version = write()
        fault = os.environ.get(LOG_FAULT_ENV)
        if fault == "retry":
            write()
        elif fault == "raise":
            raise OSError(f"[commit drill] version {version} was written; its reply was lost")
        elif fault == "exit":
            raise SystemExit(f"[commit drill] stopped after writing version {version}")
        return version
    except CommitFailedError as e:
        raise CommitConflict(" ".join(str(e).split())[:200]) from None
    except Exception as e:  # noqa: BLE001 - creating a table another writer just created
        msg = " ".join(str(e).split())
        if read_version is None and ("already exists" in msg.lower() or "version 0" in msg.lower()):
            raise CommitConflict(msg[:200]) from None
        raise


def add_columns(loc: Location, read_version: int, fields) -> int:
    """Add the nullable Arrow ``fields`` to the table's schema (one log entry); the new version.
    :class:`CommitConflict` when another writer committed after ``read_version``."""
    from deltalake import Field
    from deltalake.exceptions import CommitFailedError
    from deltalake.transaction import CommitProperties

    dt = _open(loc, read_version)
    try:
        dt.alter.add_columns([Field.from_arrow(f.with_nullable(True)) for f in fields],
                             commit_properties=CommitProperties(max_commit_retries=0))
    except CommitFailedError as e:
        raise CommitConflict(" ".join(str(e).split())[:200]) from None
    return read_version + 1
