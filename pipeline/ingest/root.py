"""Any TTree or RNTuple -> Parquet on Spark (``jobs/ingest_root.py``).

Design
------
1. **Plan.** ``resolve_files`` expands the inputs (paths, globs, ``samples:NAME`` for the cached
   coffea sample files, ``root://`` URLs and globs listed by the XRootD server, ``http(s)://`` URLs;
   remote files are opened by :func:`pipeline.fs.open_root`). The driver opens the
   first good file's tree (``tree`` names a TTree or an RNTuple: uproot reads both with the same
   ``arrays`` call) and resolves the branch selection (uproot ``filter_name`` semantics: exact
   names, globs, ``/regex/``; an RNTuple's top-level fields are its branches). The Arrow schema
   comes from a REAL read of the first entry (a zero-entry read gives other types for arrays of
   ROOT objects such as ``TLorentzVector[5]``); when the first good file is one chunk, the
   driver reads it whole for the schema and writes that part itself, so that no task reads the
   file a second time. Parts are written with :data:`PARQUET_WRITE_OPTIONS`. Jagged branches
   are ``list<T>``, fixed-size arrays (``float[5]``) ``fixed_size_list``, unsigned types stay unsigned, ROOT objects become structs.
   Every branch uproot reads and Parquet stores is converted; one that fails is skipped with one
   log line naming it and its ROOT type (asking for it by its exact name is an error). Container
   branches (whose members are branches) and an RNTuple's ``_collectionN`` storage fields (whose
   members are projected as top-level fields) are skipped unless named exactly. An RNTuple's
   cardinality fields (``nMuon``: ``RNTupleCardinality<std::uint32_t>``) get their declared
   integer type, as the TTree's counter branch has, so both kinds give the same Parquet.
2. **Phase 1, one Spark task per file** (:func:`_scan_partition`): open the file's tree metadata
   (:func:`plan_file`), check the tree and the branches, and cut the entries into ranges of about
   ``step_size`` (``"100 MB"`` of uncompressed branch data, or a number of entries), snapped to the
   basket clusters shared by the selected branches (an RNTuple: to its clusters). A file that is one chunk is converted in the
   same task (no second open); a larger file returns its ranges to the driver. Opening a Delphes
   file's metadata costs several times more than reading its physics branches, so it is done
   once per file, in parallel, rather than serially on the driver (see ``bench/ingest.py``).
   The task descriptors are built with :func:`pipeline.spark.task_frame` and every task runs
   through :func:`pipeline.spark.spark_task`: both keep the per-task overhead of the Python
   workers small, which matters because a file is a short task.
3. **Phase 2, one Spark task per chunk** of the larger files: the driver turns the ranges into a
   DataFrame of chunk descriptors (one per partition) and ``mapInArrow`` runs
   :func:`_ingest_partition` in the executors.
   In both phases a task reads with uproot into awkward arrays, converts with
   ``ak.to_arrow_table(..., extensionarray=False)`` and writes its ``part-f<file>-c<chunk>.parquet``
   itself with pyarrow, returning a small status row. Writing in the task keeps the exact Arrow
   types (Spark's Arrow bridge has no unsigned integers or fixed-size lists) and avoids a JVM
   round trip of the data; the output directory must be visible to driver and executors (local
   mode, or a shared mount).
4. **Commit.** A file that cannot be opened, lacks the tree or a requested branch, or fails while
   being read is reported (file, reason) in ``_report.json`` and one log line, and its parts are
   removed; an empty tree gives no rows and no error. Opening a file (and converting it when it
   is one chunk) and reading one chunk each run under a deadline of ``file_timeout_s``
   (:func:`read_deadline`, a SIGALRM timer in the main thread of the driver or of the Python
   worker): a file that hangs (a stuck server, a FIFO) is reported as "read timed out after N s". The output directory (``atomic_output_dir``)
   gets ``_report.json`` (per file: entries, rows, parts with their entry ranges, or the reason it
   failed) and ``_schema.json`` (a reviewed version from ``schemas/root/<tree>`` when its columns
   match; a new version is written only to ``schema_dir``, never to ``schemas/``). If
   any file failed the function raises :class:`BadInputError` after committing the good files,
   unless ``allow_bad_files`` is set.

:func:`plan_chunks` (the same per-file planning, serially on the driver), :func:`resolve_files`
and :func:`chunks_dataframe` are reused by the Delphes feature stage.
"""
from __future__ import annotations

import contextlib
import fnmatch
import glob
import logging
import os
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

from pydantic import Field, field_validator

from ..config import StageConfig
from ..errors import BadInputError, ConfigError
from ..spark import spark_task, task_frame

log = logging.getLogger(__name__)

#: Columns of the chunk-descriptor DataFrame handed to the Spark tasks.
CHUNK_COLUMNS = ("chunk_id", "file_index", "path", "tree", "entry_start", "entry_stop")
SAMPLES_PREFIX = "samples:"
#: Default limit (seconds) for opening one file's metadata, and for reading one chunk.
FILE_TIMEOUT_S = 600.0
#: How the parts are written (pyarrow.parquet.write_table): snappy, no dictionary encoding (physics
#: values rarely repeat: dictionaries cost time and grow the files), column statistics kept: the
#: settings of ``hepconvert.root_to_parquet``'s defaults with ``compression="snappy"``.
PARQUET_WRITE_OPTIONS = {"compression": "snappy", "use_dictionary": False, "write_statistics": True}


class IngestRootConfig(StageConfig):
    """Settings of ``jobs/ingest_root.py`` (uproot-like names)."""

    input: Union[str, list[str]] = Field(..., description="ROOT files: paths, globs, root:// URLs or "
                                         "samples:NAME (coffea sample files); a list or one string")
    tree: str = Field("Events", description="TTree or RNTuple name (path inside the file, e.g. 'Delphes')")
    filter_name: list[str] = Field(default_factory=lambda: ["*"],
                                   description="branches: exact names, globs or /regex/ (uproot filter_name)")
    output: str = Field("runs/root/events", description="output Parquet directory (replaced atomically)")
    step_size: Union[int, str] = Field("100 MB", description="chunk size: entries (int) or uncompressed "
                                       "size such as '100 MB'; one Spark task per chunk")
    entry_start: Optional[int] = Field(None, ge=0, description="first entry of every file (default 0)")
    entry_stop: Optional[int] = Field(None, ge=0, description="stop entry of every file (default: all)")
    allow_bad_files: bool = Field(False, description="exit 0 even if some files could not be ingested")
    schema_name: Optional[str] = Field(None, description="name under schemas/ (default root/<tree>)")
    schema_dir: Optional[str] = Field(None, description="registry folder for derived schema versions (default: none; the schema is stored next to the output as _schema.json; the repository's schemas/ is only read)")
    row_group_rows: Optional[int] = Field(None, gt=0, description="Parquet row group rows (default: one per chunk)")
    file_timeout_s: float = Field(FILE_TIMEOUT_S, gt=0, description="seconds allowed to open one file (and "
                                  "convert it when it is one chunk) and to read one chunk; a file that takes "
                                  "longer is reported as a bad file ('read timed out after N s')")

    @field_validator("input")
    @classmethod
    def _nonempty(cls, v):
        items = [v] if isinstance(v, str) else list(v)
        if not items or any(not str(x).strip() for x in items):
            raise ValueError("needs at least one non-empty path or glob")
        return v

    @field_validator("step_size")
    @classmethod
    def _step(cls, v):
        parse_step_size(v)
        return v


# --------------------------------------------------------------------------------------------
# planning (driver)
# --------------------------------------------------------------------------------------------

@dataclass
class Chunk:
    chunk_id: int
    file_index: int
    path: str
    tree: str
    entry_start: int
    entry_stop: int


@dataclass
class FileInfo:
    file_index: int
    path: str
    entries: int = 0
    chunks: int = 0
    error: Optional[str] = None


@dataclass
class BadFile:
    path: str
    reason: str


@dataclass
class Plan:
    files: list[FileInfo]
    chunks: list[Chunk]
    branches: list[str] = field(default_factory=list)   # resolved on the first good file
    schema: Any = None                                   # their Arrow schema (pyarrow.Schema)
    first_table: Any = None    # keep_first_chunk: the first good file's only chunk, read for the schema

    @property
    def bad(self) -> list[BadFile]:
        return [BadFile(f.path, f.error) for f in self.files if f.error]


_UNITS = {"b": 1, "kb": 1024, "mb": 1024 ** 2, "gb": 1024 ** 3}


def parse_step_size(v: Union[int, str]) -> tuple[str, int]:
    """``1000`` -> ('entries', 1000); ``"100 MB"`` -> ('bytes', 104857600)."""
    if isinstance(v, bool):
        raise ValueError(f"step_size {v!r}: expected entries or a size like '100 MB'")
    if isinstance(v, int):
        if v <= 0:
            raise ValueError(f"step_size {v!r} must be > 0")
        return "entries", v
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?[bB])\s*", str(v))
    if not m:
        if str(v).strip().isdigit():
            return parse_step_size(int(str(v).strip()))
        raise ValueError(f"step_size {v!r}: expected entries or a size like '100 MB'")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"step_size {v!r} must be > 0")
    return "bytes", n


class ReadTimeout(TimeoutError):
    """A file's open or a chunk's read took longer than ``file_timeout_s``."""


@contextlib.contextmanager
def read_deadline(seconds: Optional[float]):
    """Raise :class:`ReadTimeout` in the block once ``seconds`` have passed (SIGALRM timer).

    Spark's Python workers run the task function in their main thread, as the driver does; in
    another thread (where signals cannot be delivered) the block runs without a limit. A timer
    already running (an enclosing deadline) is restored afterwards with its remaining time."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _fire(signum, frame):
        raise ReadTimeout(f"read timed out after {seconds:g} s")

    t0 = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _fire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 1e-3))


def _as_list(v: Union[str, Iterable[str]]) -> list[str]:
    if isinstance(v, str):
        return [s.strip() for s in v.split(",")] if "," in v and "://" not in v else [v]
    return [str(x) for x in v]


def resolve_files(inputs: Union[str, Iterable[str]]) -> list[str]:
    """Expand paths/globs (sorted, de-duplicated, order of the patterns kept).

    ``samples:NAME`` is a file of the cached coffea samples (:func:`pipeline.samples.coffea_samples`);
    a ``root://`` glob is listed by the server (:func:`pipeline.fs.expand_remote_glob`), other
    URLs (``root://``, ``http(s)://``) are passed through. A plain path or URL that does not exist
    is kept (it is reported as a bad file later); a glob that matches nothing is a :class:`ConfigError`.
    """
    from ..fs import expand_remote_glob

    out: list[str] = []
    for item in _as_list(inputs):
        item = item.strip()
        if item.startswith(SAMPLES_PREFIX):
            from ..samples import coffea_samples
            item = str(coffea_samples() / item[len(SAMPLES_PREFIX):])
        if "://" in item and not item.startswith("file://"):
            hits = expand_remote_glob(item) if item.lower().startswith("root://") else [item]
            if not hits:
                raise ConfigError(f"input pattern matches no file: {item}")
            out.extend(hits)
            continue
        if item.startswith("file://"):
            item = item[len("file://"):]
        item = os.path.expandvars(os.path.expanduser(item))
        if glob.has_magic(item):
            hits = sorted(glob.glob(item, recursive=True))
            if not hits:
                raise ConfigError(f"input pattern matches no file: {item}")
            out.extend(os.path.abspath(h) for h in hits)
        else:
            out.append(os.path.abspath(item))
    seen, uniq = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    if not uniq:
        raise ConfigError("no input files given")
    return uniq


def _match(patterns: list[str], names: list[str]) -> tuple[list[str], list[str]]:
    """(matched names in tree order, exact names that are missing)."""
    chosen: set[str] = set()
    missing = []
    name_set = set(names)
    for pat in patterns:
        if pat in name_set:                       # exact names first: "Jet.FracPt[5]" is not a glob
            chosen.add(pat)
        elif len(pat) > 1 and pat.startswith("/") and pat.endswith("/"):
            rx = re.compile(pat[1:-1])
            chosen.update(n for n in names if rx.search(n))
        elif glob.has_magic(pat):
            chosen.update(fnmatch.filter(names, pat))
        else:
            missing.append(pat)
    return [n for n in names if n in chosen], missing


def _is_exact(patterns: list[str], name: str) -> bool:
    return name in patterns


def open_tree(path: str, tree: str):
    """Open ``path`` and return its TTree or RNTuple ``tree``, or raise BadInputError(reason)."""
    from ..fs import open_root

    try:
        f = open_root(path)
    except FileNotFoundError:
        raise BadInputError("cannot open file: no such file") from None
    except ReadTimeout:
        raise
    except Exception as e:  # uproot raises many types for a corrupt file
        raise BadInputError(f"cannot open file: {type(e).__name__}: {_first_line(e)}") from None
    try:
        t = f[tree]
    except ReadTimeout:
        raise
    except Exception as e:
        raise BadInputError(f"no tree {tree!r} in the file ({_first_line(e)})") from None
    if not hasattr(t, "num_entries") or not hasattr(t, "arrays"):
        raise BadInputError(f"{tree!r} is a {type(t).__name__}, not a TTree or an RNTuple")
    if not is_rntuple(t):
        _index_branches(t)
    return t


def _index_branches(t) -> None:
    """Make ``t[name]`` a dictionary hit for every branch name that occurs once in the TTree.

    uproot finds a name without its parent's path (``Electron.PT``) by walking the whole branch
    tree, and ``t.arrays(names)`` does that once per name: on Delphes' 1105 branches that walk
    was most of a file's conversion time (O(branches^2)). uproot's own lookup table
    (``_lookup``, the direct sub-branches by name) is extended with the nested names, so the same
    branches are found, at once; a name that occurs twice keeps uproot's search."""
    lookup = getattr(t, "_lookup", None)
    if not isinstance(lookup, dict):
        return
    pairs = list(t.iteritems(recursive=True, full_paths=False))
    counts: dict[str, int] = {}
    for name, _ in pairs:
        counts[name] = counts.get(name, 0) + 1
    for name, branch in pairs:
        if counts[name] == 1:
            lookup.setdefault(name, branch)


def is_rntuple(t) -> bool:
    from uproot.behaviors.RNTuple import RNTuple

    return isinstance(t, RNTuple)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _branches_by_name(t) -> dict:
    """Every branch by its name without the parent's path (``Electron.PT``, not
    ``Electron/Electron.PT``), from one walk of the branch tree (``t[name]`` searches the tree
    recursively for every name). For an RNTuple: its top-level fields."""
    if is_rntuple(t):
        return {name: t[name] for name in t.keys(recursive=False)}
    return dict(t.iteritems(recursive=True, full_paths=False))


def _bytes_per_entry(t, by_name: dict, branches: list[str]) -> float:
    """Uncompressed bytes per entry of ``branches`` (TTree); an RNTuple's stored bytes per entry."""
    if is_rntuple(t):
        try:
            return t.file.source.num_bytes / max(t.num_entries, 1)
        except ReadTimeout:
            raise
        except Exception:  # noqa: BLE001 - an estimate only
            return 1.0
    total = 0
    for name in branches:
        try:
            total += by_name[name].uncompressed_bytes
        except ReadTimeout:
            raise
        except Exception:  # noqa: BLE001 - an estimate only
            pass
    return total / max(t.num_entries, 1)


def _cluster_starts(t, branches: list[str]) -> list[int]:
    """Entry numbers where the basket clusters (TTree) or the clusters (RNTuple) start."""
    try:
        if is_rntuple(t):
            return [int(c.num_first_entry) for c in t.cluster_summaries]
        return [int(x) for x in t.common_entry_offsets(filter_name=branches)]
    except ReadTimeout:
        raise
    except Exception:  # noqa: BLE001 - fall back to plain ranges
        return []


def _ranges(t, by_name: dict, branches: list[str], mode: str, size: int, start: int,
            stop: int) -> list[tuple[int, int]]:
    """Entry ranges of about ``size`` (entries or bytes), snapped to the cluster boundaries."""
    if stop <= start:
        return []
    if mode == "entries":
        target = size
    else:
        target = max(1, int(size // max(_bytes_per_entry(t, by_name, branches), 1.0)))
    if stop - start <= target:
        return [(start, stop)]                     # one chunk: no need for the cluster boundaries
    bounds = [x for x in _cluster_starts(t, branches) if start < x < stop]
    cuts = [start]
    for b in bounds:
        if b - cuts[-1] >= target:
            cuts.append(b)
    if cuts[-1] != stop:
        cuts.append(stop)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        k = max(1, -(-(b - a) // target)) if (b - a) > 2 * target else 1   # split oversize clusters
        edges = [a + (b - a) * i // k for i in range(k + 1)]
        out.extend((x, y) for x, y in zip(edges[:-1], edges[1:]) if y > x)
    return out


def plan_file(path: str, tree: str, filter_name: list[str], resolved: Optional[list[str]], mode: str, size: int,
              entry_start: Optional[int] = None, entry_stop: Optional[int] = None):
    """Open one file's tree metadata: (tree, branches, entries, entry ranges, schema). BadInputError
    if unusable. ``resolved`` is the branch list fixed by the first good file (None: resolve it
    here, with its Arrow schema; otherwise the schema is None).
    """
    return _plan_file(path, tree, filter_name, resolved, mode, size, entry_start, entry_stop)[:5]


def _plan_file(path: str, tree: str, filter_name: list[str], resolved: Optional[list[str]], mode: str, size: int,
               entry_start: Optional[int] = None, entry_stop: Optional[int] = None, keep_chunk: bool = False):
    """:func:`plan_file` plus the table the schema was read from. With ``keep_chunk``, a file
    (resolving the branches) whose entries [0, stop) are one chunk is read whole for its schema,
    so that the caller can write that table instead of reading the file a second time; otherwise
    the table holds the first entry only."""
    t = open_tree(path, tree)
    by_name = _branches_by_name(t)
    matched, missing = _match(filter_name, list(by_name))
    if missing:
        raise BadInputError(f"missing branch {missing[0]!r} in tree {tree!r}")
    if not matched:
        raise BadInputError(f"no branch of tree {tree!r} matches {filter_name}")
    n = int(t.num_entries)
    a = min(entry_start or 0, n)
    b = n if entry_stop is None else min(entry_stop, n)
    schema = table = None
    if resolved is None:       # the matched branches' size bounds the converted ones' from above
        whole = keep_chunk and a == 0 and len(_ranges(t, by_name, matched, mode, size, a, b)) <= 1
        resolved, schema, table = _supported(t, matched, filter_name, b if whole else 1)
    else:
        have = set(matched)
        absent = [x for x in resolved if x not in have]
        if absent:
            raise BadInputError(f"missing branch {absent[0]!r} in tree {tree!r}")
    ranges = _ranges(t, by_name, resolved, mode, size, a, b)
    if table is not None and (ranges != [(0, table.num_rows)] or table.num_rows == 0):
        table = None
    return t, resolved, max(0, b - a), ranges, schema, table


def _error_text(e: BaseException) -> str:
    return str(e) if isinstance(e, (BadInputError, ReadTimeout)) else f"{type(e).__name__}: {_first_line(e)}"


def plan_chunks(files: list[str], tree: str, filter_name: list[str], step_size: Union[int, str] = "100 MB",
                entry_start: Optional[int] = None, entry_stop: Optional[int] = None,
                progress: bool = True, stop_after_first_good: bool = False,
                file_timeout_s: Optional[float] = FILE_TIMEOUT_S, keep_first_chunk: bool = False) -> Plan:
    """Open each file's tree metadata on the driver and cut it into chunks; bad files (also one
    that takes longer than ``file_timeout_s``) are recorded, not raised. The branch selection and
    the Arrow schema come from the first good file; with ``keep_first_chunk``, when that file is
    one chunk starting at entry 0, it is read whole for the schema and kept as ``first_table``."""
    mode, size = parse_step_size(step_size)
    infos: list[FileInfo] = []
    chunks: list[Chunk] = []
    resolved: Optional[list[str]] = None
    schema = first_table = None
    it: Iterable = enumerate(files)
    if progress and len(files) > 3 and not stop_after_first_good:
        from tqdm import tqdm
        it = tqdm(it, total=len(files), desc="planning ROOT chunks", unit="file", leave=False)
    for i, path in it:
        info = FileInfo(i, path)
        infos.append(info)
        try:
            with read_deadline(file_timeout_s):
                t, branches, info.entries, ranges, found, table = _plan_file(
                    path, tree, filter_name, resolved, mode, size, entry_start, entry_stop,
                    keep_chunk=keep_first_chunk and resolved is None)
            if resolved is None:
                resolved, schema, first_table = branches, found, (table if keep_first_chunk else None)
            for x, y in ranges:
                chunks.append(Chunk(len(chunks), i, path, tree, x, y))
                info.chunks += 1
        except Exception as e:  # noqa: BLE001 - a broken file must not stop the others
            info.error = _error_text(e)
            log.warning("bad input file %s: %s", path, info.error)
            continue
        if stop_after_first_good:
            break
    return Plan(infos, chunks, resolved or [], schema, first_table)


#: an RNTuple's storage field of a collection whose members are also top-level (projected) fields
_INTERNAL_FIELD = re.compile(r"_collection\d+$")


def _candidates(t, matched: list[str], patterns: list[str]) -> tuple[list[str], list[str]]:
    """(branches to try, skipped names): a TTree branch with sub-branches is a container and an
    RNTuple's ``_collectionN`` duplicates its projected fields; both are skipped unless named exactly."""
    rntuple = is_rntuple(t)
    keep, skipped = [], []
    for name in matched:
        if _is_exact(patterns, name):
            keep.append(name)
        elif (rntuple and _INTERNAL_FIELD.match(name)) or (not rntuple and len(t[name].branches)):
            skipped.append(name)
        else:
            keep.append(name)
    return keep, skipped


def _root_type(t, name: str) -> str:
    try:
        return str(t[name].typename)
    except ReadTimeout:
        raise
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


def _probe(t, names: list[str], stop: int = 1):
    """The Arrow table of a real read of entries [0, stop) (none for an empty tree), written to an
    in-memory Parquet file: what a task will produce, or the exception that stops it."""
    import io

    import pyarrow.parquet as pq

    table = to_arrow(read_arrays(t, names, 0, min(stop, int(t.num_entries))))
    pq.write_table(table, io.BytesIO(), compression="none", use_dictionary=False)
    return table


def _supported(t, matched: list[str], patterns: list[str], stop: int = 1):
    """(branches, Arrow schema, table of entries [0, stop)): the matched branches (fields) that
    uproot reads and Parquet stores, with the types of a REAL read (a zero-entry read gives other
    types for arrays of ROOT objects). A branch that fails is skipped with one log line naming it
    and its ROOT type, or is an error when it was asked for by its exact name."""
    names, skipped = _candidates(t, matched, patterns)
    if skipped:
        log.info("skipping %d container/collection branch(es) whose members are branches (e.g. %s)",
                 len(skipped), ", ".join(skipped[:3]))
    try:
        table = _probe(t, names, stop)
    except ReadTimeout:
        raise
    except Exception:  # noqa: BLE001 - find the branches that fail, one by one
        good, failed = [], []
        for name in names:
            try:
                _probe(t, [name])
                good.append(name)
            except ReadTimeout:
                raise
            except Exception as e:  # noqa: BLE001
                failed.append(f"branch {name!r} ({_root_type(t, name)}) cannot be converted: "
                              f"{type(e).__name__}: {_first_line(e)}")
                if _is_exact(patterns, name):
                    raise BadInputError(failed[-1]) from None
        if not good:                               # nothing readable: the file, not a branch, is broken
            raise BadInputError(failed[0] if failed else f"no branch matches {patterns}") from None
        for why in failed:
            log.warning("skipping %s", why)
        names = good
        table = _probe(t, names, stop)
    return names, _declared_types(t, table.schema), table


def _declared_types(t, schema):
    """An RNTuple's cardinality fields (``RNTupleCardinality<std::uint32_t>``: uproot reads int64)
    get the declared integer type, as the equivalent TTree counter branch has."""
    import pyarrow as pa

    if not is_rntuple(t):
        return schema
    ints = {"std::uint32_t": pa.uint32(), "std::uint64_t": pa.uint64(), "std::int32_t": pa.int32(),
            "std::int64_t": pa.int64()}
    for i, f in enumerate(schema):
        m = re.fullmatch(r"ROOT::RNTupleCardinality<(.+)>", _root_type(t, f.name))
        if m and m.group(1) in ints:
            schema = schema.set(i, f.with_type(ints[m.group(1)]))
    return schema


def arrow_schema(t, branches: list[str]):
    """The Arrow schema of ``branches`` as the tasks write them (a real read of the first entry)."""
    return _declared_types(t, _probe(t, branches).schema)


def to_arrow(arr):
    """awkward record array -> pyarrow Table with plain (non-extension) types and 32-bit offsets."""
    import awkward as ak

    table = ak.to_arrow_table(arr, extensionarray=False, list_to32=True, string_to32=True)
    return table.replace_schema_metadata(None)


def chunks_dataframe(spark, chunks: list[Chunk], tasks: Optional[list[int]] = None):
    """A DataFrame of chunk descriptors, one chunk per partition (so Spark balances the chunks),
    or ``tasks``: the partition of each chunk (see :func:`~pipeline.spark.task_frame`)."""
    return task_frame(spark, [(c.chunk_id, c.file_index, c.path, c.tree, c.entry_start, c.entry_stop) for c in chunks],
                      "chunk_id int, file_index int, path string, tree string, entry_start long, entry_stop long",
                      tasks)


# --------------------------------------------------------------------------------------------
# the Spark task
# --------------------------------------------------------------------------------------------

_OPEN: dict = {}


def cached_tree(path: str, tree: str):
    """The last opened tree of this Python worker (chunks of one file often share a worker)."""
    key = (path, tree)
    if key not in _OPEN:
        _OPEN.clear()
        _OPEN[key] = open_tree(path, tree)
    return _OPEN[key]


def read_chunk(path: str, tree: str, branches: list[str], entry_start: int, entry_stop: int,
               timeout_s: Optional[float] = FILE_TIMEOUT_S):
    """uproot -> awkward record array of one entry range (:class:`ReadTimeout` after ``timeout_s``)."""
    with read_deadline(timeout_s):
        return read_arrays(cached_tree(path, tree), branches, entry_start, entry_stop)


def read_arrays(t, branches: list[str], entry_start: int, entry_stop: int):
    """The ``branches`` of entries [entry_start, entry_stop) of a TTree or RNTuple, in that order
    (an RNTuple read of a cardinality field also returns its ``_collectionN``: dropped)."""
    arr = t.arrays(branches, entry_start=entry_start, entry_stop=entry_stop, library="ak")
    return arr if arr.fields == branches else arr[branches]


STATUS_FIELDS = [("chunk_id", "int32"), ("file_index", "int32"), ("rows", "int64"), ("bytes", "int64"),
                 ("seconds", "float64"), ("part", "string"), ("error", "string")]
SCAN_FIELDS = [("file_index", "int32"), ("entries", "int64"), ("starts", "list<int64>"), ("stops", "list<int64>"),
               ("rows", "list<int64>"), ("parts", "list<string>"), ("done", "bool"), ("error", "string")]


def _pa_schema(fields):
    import pyarrow as pa
    m = {"list<int64>": pa.list_(pa.int64()), "list<string>": pa.list_(pa.string())}
    return pa.schema([(n, m.get(t, t)) for n, t in fields])


def _spark_schema(fields):
    from pyspark.sql.types import (ArrayType, BooleanType, DoubleType, IntegerType, LongType, StringType,
                                   StructField, StructType)
    m = {"int32": IntegerType(), "int64": LongType(), "float64": DoubleType(), "string": StringType(),
         "bool": BooleanType(), "list<int64>": ArrayType(LongType()), "list<string>": ArrayType(StringType())}
    return StructType([StructField(n, m[t], True) for n, t in fields])


def part_name(file_index: int, chunk_id: int) -> str:
    return f"part-f{file_index:05d}-c{chunk_id:05d}.parquet"


def _convert(t, branches: list[str], schema, a: int, b: int, out_dir: str, part: str,
             row_group_rows: Optional[int]) -> tuple[int, int]:
    """Read entries [a, b) of tree ``t``, write ``out_dir/part``; (rows, bytes). No file for 0 rows."""
    return _write_part(to_arrow(read_arrays(t, branches, a, b)), schema, out_dir, part, row_group_rows)


def schema_bytes(schema) -> bytes:
    """An Arrow schema for the Spark tasks, as Arrow IPC bytes: pickling a ``pyarrow.Schema``
    drops the value field of a ``fixed_size_list`` (its name and ``not null``), and the tasks
    would then cast every chunk to a schema other than the one the driver records."""
    return schema.serialize().to_pybytes()


def _as_schema(schema):
    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(schema)) if isinstance(schema, bytes) else schema


def _write_part(table, schema, out_dir: str, part: str, row_group_rows: Optional[int]) -> tuple[int, int]:
    """Write ``table`` (cast to ``schema``) as ``out_dir/part``; (rows, bytes). No file for 0 rows."""
    import pyarrow.parquet as pq

    if table.schema != schema:
        table = _conform(table, schema)
    if table.num_rows == 0:
        return 0, 0
    path = os.path.join(out_dir, part)
    pq.write_table(table, path, row_group_size=row_group_rows, **PARQUET_WRITE_OPTIONS)
    return table.num_rows, os.path.getsize(path)


def _scan_partition(batches: Iterator, *, tree: str, filter_name: list[str], branches: list[str], schema,
                    out_dir: str, mode: str, size: int, entry_start, entry_stop, row_group_rows,
                    file_timeout_s: Optional[float] = FILE_TIMEOUT_S) -> Iterator:
    """Phase 1, one task per file: open the metadata and cut the entry ranges; a file that is a
    single chunk is converted right here (no second open); larger files return their ranges.
    Opening (and converting) one file takes at most ``file_timeout_s``."""
    import pyarrow as pa

    schema = _as_schema(schema)
    for batch in batches:
        d = batch.to_pydict()
        rows = []
        for fi, path in zip(d["file_index"], d["path"]):
            r = {"file_index": fi, "entries": 0, "starts": [], "stops": [], "rows": [], "parts": [],
                 "done": False, "error": None}
            try:
                with read_deadline(file_timeout_s):
                    t, _, r["entries"], ranges, _ = plan_file(path, tree, filter_name, branches, mode, size,
                                                              entry_start, entry_stop)
                    r["starts"], r["stops"] = [x for x, _ in ranges], [y for _, y in ranges]
                    if len(ranges) <= 1:
                        r["done"] = True
                        for x, y in ranges:
                            part = part_name(fi, 0)
                            n, _ = _convert(t, branches, schema, x, y, out_dir, part, row_group_rows)
                            r["rows"], r["parts"] = [n], [part if n else None]
            except Exception as e:  # noqa: BLE001 - reported per file by the driver
                r["error"] = _error_text(e)
                _remove_part(out_dir, part_name(fi, 0))
            rows.append(r)
        yield pa.RecordBatch.from_pylist(rows, schema=_pa_schema(SCAN_FIELDS))


def _remove_part(out_dir: str, part: str) -> None:
    """A part interrupted while being written (a timeout) must not be left behind."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(out_dir, part))


def _ingest_partition(batches: Iterator, *, branches: list[str], schema, out_dir: str,
                      row_group_rows: Optional[int], file_timeout_s: Optional[float] = FILE_TIMEOUT_S) -> Iterator:
    """Phase 2, one task per chunk of a multi-chunk file: read it (at most ``file_timeout_s``),
    write its part, yield a status row."""
    import pyarrow as pa

    schema = _as_schema(schema)
    for batch in batches:
        d = batch.to_pydict()
        rows = []
        for cid, fi, path, tree, a, b in zip(*(d[c] for c in CHUNK_COLUMNS)):
            t0 = time.time()
            part, n, nbytes, err = part_name(fi, cid), 0, 0, None
            try:
                with read_deadline(file_timeout_s):
                    n, nbytes = _convert(cached_tree(path, tree), branches, schema, a, b, out_dir, part,
                                         row_group_rows)
            except Exception as e:  # noqa: BLE001 - reported per file by the driver
                err = _error_text(e)
                _remove_part(out_dir, part)
            rows.append({"chunk_id": cid, "file_index": fi, "rows": n, "bytes": nbytes,
                         "seconds": time.time() - t0, "part": part if n else None, "error": err})
        yield pa.RecordBatch.from_pylist(rows, schema=_pa_schema(STATUS_FIELDS))


def _conform(table, schema):
    """Cast a chunk to the dataset schema or raise BadInputError naming the first differing branch."""
    for f in schema:
        i = table.schema.get_field_index(f.name)
        if i < 0:
            raise BadInputError(f"missing branch {f.name!r}")
        got = table.schema.field(i).type
        if got != f.type:
            try:
                table = table.set_column(i, f.name, table.column(i).cast(f.type))
            except Exception:  # noqa: BLE001
                raise BadInputError(f"branch {f.name!r} has type {got} here, {f.type} in the first file") from None
    return table.select(schema.names).cast(schema)


# --------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------

def default_schema_name(tree: str) -> str:
    return "root/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", tree.strip("/")).lower()


def plan_ingest_root(cfg: IngestRootConfig) -> dict:
    """--dry-run: the resolved inputs and outputs (no file is opened, Spark is not started)."""
    from ..fs import location

    files = resolve_files(cfg.input)
    out = location(cfg.output, output=True)
    return {"inputs": files, "tree": cfg.tree, "filter_name": cfg.filter_name, "step_size": cfg.step_size,
            "file_timeout_s": cfg.file_timeout_s, "output": str(out), "report": str(out.child("_report.json")),
            "schema": str(out.child("_schema.json")), "schema_name": cfg.schema_name or default_schema_name(cfg.tree)}


def ingest_root(cfg: IngestRootConfig, spark=None) -> dict:
    """Ingest the ROOT files of ``cfg`` into one Parquet directory; returns the run report.

    The driver resolves the branches and the schema on the first good file. Phase 1 (one Spark
    task per file) opens each file's metadata, cuts its entry ranges and converts the files that
    are a single chunk on the spot; phase 2 distributes the chunks of the larger files (one task
    per chunk). Raises BadInputError (after committing the good files) if a file failed and
    ``allow_bad_files`` is false, or if no file could be read at all.
    """
    import functools

    from ..fs import location
    from ..outputs import atomic_output_dir, check_staging, write_json
    from ..schemas import register_schema
    from ..spark import get_spark

    t_start = time.time()
    files = resolve_files(cfg.input)
    mode, size = parse_step_size(cfg.step_size)
    log.info("ingest_root: %d file(s), tree %r, branches %s", len(files), cfg.tree, cfg.filter_name)
    ref = plan_chunks(files, cfg.tree, cfg.filter_name, cfg.step_size, cfg.entry_start, cfg.entry_stop,
                      stop_after_first_good=True, file_timeout_s=cfg.file_timeout_s, keep_first_chunk=True)
    if ref.schema is None:
        raise BadInputError(f"no input file could be read; {files[0]}: {ref.files[0].error}")
    errors = {f.file_index: f.error for f in ref.files if f.error}
    first_good = len(ref.files) - 1
    branches, schema = ref.branches, ref.schema
    spark = spark or get_spark(cfg.spark)
    check_staging(spark.sparkContext.master, cfg.output, "ROOT ingestion")
    with atomic_output_dir(cfg.output) as tmp:
        first = _write_first(ref, first_good, schema, str(tmp), cfg.row_group_rows)
        todo = [(i, p) for i, p in enumerate(files) if i >= first_good and not (first and i == first_good)]
        scan = functools.partial(_scan_partition, tree=cfg.tree, filter_name=cfg.filter_name, branches=branches,
                                 schema=schema_bytes(schema), out_dir=str(tmp), mode=mode, size=size,
                                 entry_start=cfg.entry_start, entry_stop=cfg.entry_stop,
                                 row_group_rows=cfg.row_group_rows, file_timeout_s=cfg.file_timeout_s)
        scanned = dict(first)
        if todo:
            fdf = task_frame(spark, todo, "file_index int, path string")
            scanned.update((r["file_index"], r.asDict()) for r in
                           fdf.mapInArrow(spark_task(scan), _spark_schema(SCAN_FIELDS)).collect())
        chunks = []
        for fi, r in sorted(scanned.items()):
            if not r["error"] and not r["done"]:
                for a, b in zip(r["starts"], r["stops"]):
                    chunks.append(Chunk(len(chunks), fi, files[fi], cfg.tree, a, b))
        statuses = []
        if chunks:
            log.info("ingest_root: %d chunk(s) of %d large file(s) -> Spark tasks", len(chunks),
                     len({c.file_index for c in chunks}))
            fn = functools.partial(_ingest_partition, branches=branches, schema=schema_bytes(schema), out_dir=str(tmp),
                                   row_group_rows=cfg.row_group_rows, file_timeout_s=cfg.file_timeout_s)
            statuses = [r.asDict() for r in chunks_dataframe(spark, chunks).mapInArrow(
                spark_task(fn), _spark_schema(STATUS_FIELDS)).collect()]
        per_file = _summarise(files, errors, scanned, chunks, statuses, tmp)
        n_rows = sum(f["rows"] for f in per_file if not f.get("error"))
        if not any(p.suffix == ".parquet" for p in tmp.iterdir()):
            import pyarrow.parquet as pq
            pq.write_table(schema.empty_table(), tmp / "part-empty.parquet")   # readers still see the columns
        name = cfg.schema_name or default_schema_name(cfg.tree)
        ds = register_schema(name, schema, description=f"ROOT tree {cfg.tree!r} ingested by jobs/ingest_root.py",
                             metadata={"tree": cfg.tree, "filter_name": cfg.filter_name},
                             registry_dir=Path(cfg.schema_dir) if cfg.schema_dir else None)
        report = {"job": "ingest_root", "tree": cfg.tree, "filter_name": cfg.filter_name,
                  "branches": branches, "schema": {"name": ds.name, "version": ds.version},
                  "output": str(location(cfg.output, output=True)), "rows": n_rows,
                  "files": per_file, "bad_files": [{"file": f["file"], "reason": f["error"]}
                                                   for f in per_file if f.get("error")],
                  "seconds": round(time.time() - t_start, 3)}
        write_json(tmp / "_report.json", report)
        write_json(tmp / "_schema.json", ds.to_json())
    for f in per_file:
        if not f.get("error"):
            print(f"{f['file']}: {f['entries']} entries read, {f['rows']} rows written in {len(f['parts'])} part(s)")
    log.info("ingest_root: %d rows from %d good file(s), %d bad -> %s", n_rows,
             len(per_file) - len(report["bad_files"]), len(report["bad_files"]), report["output"])
    if report["bad_files"] and not cfg.allow_bad_files:
        b = report["bad_files"][0]
        raise BadInputError(f"{len(report['bad_files'])} of {len(files)} input file(s) failed (see "
                            f"{report['output']}/_report.json); {b['file']}: {b['reason']}")
    return report


def _write_first(ref: Plan, fi: int, schema, out_dir: str, row_group_rows: Optional[int]) -> dict:
    """The first good file, when the driver read it whole for the schema (one chunk): written here
    rather than read again by a task; its scan row ({} when a task must convert it)."""
    table, ref.first_table = ref.first_table, None
    if table is None:
        return {}
    part = part_name(fi, 0)
    try:
        n, _ = _write_part(table, schema, out_dir, part, row_group_rows)
    except Exception as e:  # noqa: BLE001 - a task converts it and reports it
        log.info("first file written by a task (%s)", _first_line(e))
        _remove_part(out_dir, part)
        return {}
    return {fi: {"file_index": fi, "entries": ref.files[fi].entries, "starts": [0], "stops": [table.num_rows],
                 "rows": [n], "parts": [part if n else None], "done": True, "error": None}}


def _summarise(files: list[str], errors: dict, scanned: dict, chunks: list[Chunk], statuses: list[dict],
               out_dir: Path) -> list[dict]:
    """Per-file report (one log line per bad file); the parts of a file that failed are deleted."""
    by_file: dict[int, list[dict]] = {}
    chunk_of = {c.chunk_id: c for c in chunks}
    for s in statuses:
        by_file.setdefault(s["file_index"], []).append(s)
    out = []
    for fi, path in enumerate(files):
        r = scanned.get(fi)
        parts: list[dict] = []
        err = errors.get(fi) or (r["error"] if r else None)
        if r and not err:
            if r["done"]:
                parts = [{"part": p, "rows": n, "entry_start": a, "entry_stop": b}
                         for p, n, a, b in zip(r["parts"], r["rows"], r["starts"], r["stops"]) if p]
            else:
                sts = sorted(by_file.get(fi, []), key=lambda s: s["chunk_id"])
                err = next((s["error"] for s in sts if s["error"]), None)
                parts = [{"part": s["part"], "rows": s["rows"], "entry_start": chunk_of[s["chunk_id"]].entry_start,
                          "entry_stop": chunk_of[s["chunk_id"]].entry_stop} for s in sts if s["part"]]
        if err:
            if fi not in errors:
                log.warning("bad input file %s: %s", path, err)
            for p in parts:
                (out_dir / p["part"]).unlink(missing_ok=True)
            parts = []
        out.append({"file": path, "file_index": fi, "entries": r["entries"] if r else 0,
                    "rows": sum(p["rows"] for p in parts), "parts": parts, "error": err})
    return out
