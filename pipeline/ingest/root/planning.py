"""Cutting a ROOT file into chunks: entry ranges of about ``step_size``, snapped to the basket
clusters the selected branches share (an RNTuple: to its clusters)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from ...errors import BadInputError
from ...spark import task_frame
from .config import FILE_TIMEOUT_S, parse_step_size
from .deadline import ReadTimeout, read_deadline
from .schema import supported_branches
from .trees import branches_by_name, error_text, is_rntuple, match_branches, open_tree

log = logging.getLogger(__name__)

#: Columns of the chunk-descriptor DataFrame handed to the Spark tasks.
CHUNK_COLUMNS = ("chunk_id", "file_index", "path", "tree", "entry_start", "entry_stop")


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


def _plan_file(path: str, tree: str, filter_name: list[str], resolved: Optional[list[str]], mode: str,
                        size: int, entry_start: Optional[int] = None, entry_stop: Optional[int] = None,
                        keep_chunk: bool = False):
    """:func:`plan_file` plus the table the schema was read from. With ``keep_chunk``, a file
    (resolving the branches) whose entries [0, stop) are one chunk is read whole for its schema,
    so that the caller can write that table instead of reading the file a second time; otherwise
    the table holds the first entry only."""
    t = open_tree(path, tree)
    by_name = branches_by_name(t)
    matched, missing = match_branches(filter_name, list(by_name))
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
        resolved, schema, table = supported_branches(t, matched, filter_name, b if whole else 1)
    else:
        have = set(matched)
        absent = [x for x in resolved if x not in have]
        if absent:
            raise BadInputError(f"missing branch {absent[0]!r} in tree {tree!r}")
    ranges = _ranges(t, by_name, resolved, mode, size, a, b)
    if table is not None and (ranges != [(0, table.num_rows)] or table.num_rows == 0):
        table = None
    return t, resolved, max(0, b - a), ranges, schema, table


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
            info.error = error_text(e)
            log.warning("bad input file %s: %s", path, info.error)
            continue
        if stop_after_first_good:
            break
    return Plan(infos, chunks, resolved or [], schema, first_table)


def chunks_dataframe(spark, chunks: list[Chunk], tasks: Optional[list[int]] = None):
    """A DataFrame of chunk descriptors, one chunk per partition (so Spark balances the chunks),
    or ``tasks``: the partition of each chunk (see :func:`~pipeline.spark.task_frame`)."""
    return task_frame(spark, [(c.chunk_id, c.file_index, c.path, c.tree, c.entry_start, c.entry_stop) for c in chunks],
                      "chunk_id int, file_index int, path string, tree string, entry_start long, entry_stop long",
                      tasks)
