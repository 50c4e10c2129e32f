"""Input files that always fail: counted in the table's commit records, quarantined after
``quarantine_after`` failed only-new runs, skipped by later runs with one line, retried on request.

Every commit of an only-new run records the inputs that failed (``bad_files``: path, reason and
the file's stat, :func:`~.ledger.source_stat`); a run whose every new input failed commits a
version that changes no data and carries only that record (:func:`record_failures`), so each
failed run counts. :func:`read_state` replays the commits: a file's failures count up while its
stat stays the same, and start again at one when it changed (a new upload is a new file), or at
zero once a run ingested it. When a run's failure brings a file's count to ``quarantine_after``,
the run records it under ``quarantined`` (with its reason) and the file no longer fails that run
or any later one: later runs skip it with one line (:func:`skip_line`) until its stat changes or a
run sets ``retry_quarantined`` (one more try; a failure quarantines it again at once). The
quarantined files are listed by ``jobs/ingest_root.py ... --dry-run`` (docs/ingestion.md).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from ..fs import Location
from . import deltalog
from .ledger import identity, same_file

log = logging.getLogger(__name__)

#: failed only-new runs after which an input file is quarantined (the ``quarantine_after`` default)
QUARANTINE_AFTER = 3
#: the stat keys a failure record keeps (what tells a changed file from the one that failed)
STAT_KEYS = ("file", "size", "mtime_ns", "real", "etag", "sha256")


@dataclass
class Failed:
    """One input's failures since it last changed or was ingested."""

    stat: dict
    reason: str
    failures: int
    version: int                      # the commit of its latest failure
    quarantined: Optional[int] = None  # the version that quarantined it


@dataclass
class State:
    """The failed inputs of a table (by :func:`~.ledger.identity`) and its newest version."""

    version: Optional[int]
    failed: dict = field(default_factory=dict)

    def quarantined(self, stat: dict) -> Optional[Failed]:
        """The quarantine of the input with ``stat``; None when it is not quarantined or changed since."""
        f = self.failed.get(identity(stat))
        return f if f is not None and f.quarantined is not None and same_file(f.stat, stat) else None

    def failures(self, stat: dict) -> int:
        """Failed runs of the input with ``stat`` so far (0 when it changed since)."""
        f = self.failed.get(identity(stat))
        return f.failures if f is not None and same_file(f.stat, stat) else 0


def read_state(loc: Location) -> State:
    """Replay the table's commit records (an empty state when ``loc`` holds no table)."""
    if not deltalog.is_table(loc):
        return State(None)
    st = State(None)
    for v, rec in deltalog.commits(loc):
        st.version = v
        if rec.get("overwrite"):
            st.failed.clear()
        for s in rec.get("sources") or []:
            st.failed.pop(identity(s), None)
        quarantined = {identity(q) for q in rec.get("quarantined") or []}
        for b in rec.get("bad_files") or []:
            if "size" not in b:                     # a record without the file's stat: not counted
                continue
            key = identity(b)
            prev = st.failed.get(key)
            n = prev.failures + 1 if prev is not None and same_file(prev.stat, b) else 1
            st.failed[key] = Failed({k: b[k] for k in STAT_KEYS if k in b}, b.get("reason") or "", n, v,
                                    v if key in quarantined else (prev.quarantined if prev and n > 1 else None))
    return st


def split(files: list[str], stats: dict, state: State, retry: bool) -> tuple[list[str], list[str]]:
    """``files`` without the quarantined ones (one line each), and those; with ``retry`` every file
    is kept (one line per quarantined file tried again)."""
    keep, skipped = [], []
    for f in files:
        q = state.quarantined(stats[f])
        if q is None:
            keep.append(f)
        elif retry:
            print(f"{f}: quarantined at version {q.quarantined}; tried again (retry_quarantined)")
            keep.append(f)
        else:
            print(skip_line(f, q))
            skipped.append(f)
    return keep, skipped


def listing(loc: Location) -> list[dict]:
    """The quarantined inputs of the table ``loc``: file, reason, failed runs, the version that
    quarantined it (``--dry-run`` prints them)."""
    return [{"file": f.stat["file"], "reason": f.reason, "failures": f.failures, "version": f.quarantined}
            for f in read_state(loc).failed.values() if f.quarantined is not None]


def job_id() -> str:
    """The id of a commit that only records failures (12 hex digits, as a DeltaJob's)."""
    return uuid.uuid4().hex[:12]


def skip_line(path: str, q: Failed) -> str:
    return (f"{path}: quarantined at version {q.quarantined} after {q.failures} failed run(s) ({q.reason}); "
            "skipped: replace the file, or rerun with --set retry_quarantined=true to try it again")


def mark(record: dict, stats: dict, state: State, after: int) -> list[dict]:
    """Add each bad file's stat to the commit ``record`` and quarantine (``record["quarantined"]``)
    the ones whose failure count reaches ``after`` with this run (0: never); the quarantined ones,
    one line each."""
    out = []
    for b in record.get("bad_files") or []:
        st = stats.get(b["file"]) or {"file": b["file"]}
        b.update({k: st[k] for k in STAT_KEYS if k in st})
        n = state.failures(st) + 1
        if after and n >= after:
            out.append({"file": b["file"], "reason": b["reason"], "failures": n,
                        **{k: st[k] for k in STAT_KEYS if k in st}})
            print(f"{b['file']}: quarantined after {n} failed run(s) ({b['reason']}); later runs skip it "
                  "(list: --dry-run; retry: --set retry_quarantined=true)")
    record["quarantined"] = out
    return out


def record_failures(loc: Location, record: dict, retries: int = 20) -> int:
    """Commit ``record`` (the failures of a run that has no data to add) as a version that changes no
    data; the new version. A commit another writer made first is read past (this one adds nothing,
    so it never conflicts)."""
    for _ in range(retries):
        snap = deltalog.snapshot(loc)
        try:
            return deltalog.commit(loc, snap.version, [], [], snap.schema, list(snap.partition_by), record)
        except deltalog.CommitConflict:
            time.sleep(0.05)
    raise RuntimeError(f"{loc}: {retries} other commits came first; the failures of this run were not recorded")
