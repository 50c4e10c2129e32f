"""Cutting a ROOT file into chunks: entry ranges of about ``step_size``, snapped to the basket
clusters the selected branches share (an RNTuple: to its clusters)."""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from ...errors import BadInputError
from ...spark import task_frame
from .baskets import basket_maps
from .config import FILE_TIMEOUT_S, parse_step_size
from .deadline import ReadTimeout, read_deadline
from .schema import supported_branches
from .trees import branches_by_name, error_text, is_rntuple, match_branches, open_tree

log = logging.getLogger(__name__)

#: Columns of the chunk-descriptor DataFrame handed to the Spark tasks.
CHUNK_COLUMNS = ("chunk_id", "file_index", "path", "tree", "entry_start", "entry_stop", "baskets")


@dataclass
class Chunk:
    chunk_id: int
    file_index: int
    path: str
    tree: str
    entry_start: int
    entry_stop: int
    baskets: Optional[bytes] = None   # the range's basket map (:func:`~.baskets.basket_maps`), if made


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


def _cluster_starts(t, by_name: dict, branches: list[str]) -> list[int]:
    """Entry numbers where the basket clusters (TTree: where every selected branch with baskets
    starts a basket, uproot's ``common_entry_offsets`` rule over the branch objects themselves,
    not a name filter over the tree) or the clusters (RNTuple) start."""
    try:
        if is_rntuple(t):
            return [int(c.num_first_entry) for c in t.cluster_summaries]
        common: Optional[set] = None
        for name in branches:
            b = by_name[name]
            if b.num_baskets == 0:
                continue
            own = {int(x) for x in b.entry_offsets}
            common = own if common is None else common & own
        return [0] if common is None else sorted(common)
    except ReadTimeout:
        raise
    except Exception:  # noqa: BLE001 - fall back to plain ranges
        return []


def _nearest(sorted_values: list[int], x: int) -> int:
    """The value of ``sorted_values`` nearest ``x`` (ties: the smaller)."""
    i = bisect.bisect_left(sorted_values, x)
    near = sorted_values[max(0, i - 1):i + 1]
    return min(near, key=lambda v: (abs(v - x), v))


def cut_ranges(start: int, stop: int, target: int, bounds: list[int], spread: int = 1) -> list[tuple[int, int]]:
    """Entries [start, stop) in ranges of about ``target`` entries: k = ceil(n / target) even cuts
    (rounded up to a multiple of ``spread`` when the range is more than one chunk, so that
    ``spread`` task slots get equal shares of one file), each moved to the nearest cluster start in
    ``bounds`` (ties: the earlier one). A range still over twice the target (a cluster larger than
    that) is split evenly."""
    if stop <= start:
        return []
    n = stop - start
    k = -(-n // max(1, target))
    if k <= 1:
        return [(start, stop)]                     # one chunk: no need for the cluster boundaries
    k = -(-k // max(1, spread)) * max(1, spread)
    inside = sorted({b for b in bounds if start < b < stop})
    cuts = [start]
    for i in range(1, k):
        ideal = start + n * i // k
        edge = _nearest(inside, ideal) if inside else ideal
        if edge > cuts[-1]:
            cuts.append(edge)
    if cuts[-1] != stop:
        cuts.append(stop)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        m = -(-(b - a) // target) if (b - a) > 2 * target else 1   # split oversize clusters
        edges = [a + (b - a) * i // m for i in range(m + 1)]
        out.extend((x, y) for x, y in zip(edges[:-1], edges[1:]) if y > x)
    return out


def _ranges(t, by_name: dict, branches: list[str], mode: str, size: int, start: int,
            stop: int, spread: int = 1) -> list[tuple[int, int]]:
    """Entry ranges of about ``size`` (entries or bytes), snapped to the cluster boundaries
    (:func:`cut_ranges`)."""
    if stop <= start:
        return []
    if mode == "entries":
        target = size
    else:
        target = max(1, int(size // max(_bytes_per_entry(t, by_name, branches), 1.0)))
    if stop - start <= target:
        return [(start, stop)]                     # one chunk: the cluster boundaries are not read
    return cut_ranges(start, stop, target, _cluster_starts(t, by_name, branches), spread)


def plan_file(path: str, tree: str, filter_name: list[str], resolved: Optional[list[str]], mode: str, size: int,
              entry_start: Optional[int] = None, entry_stop: Optional[int] = None, spread: int = 1):
    """Open one file's tree metadata: (tree, branches, entries, entry ranges, schema). BadInputError
    if unusable. ``resolved`` is the branch list fixed by the first good file (None: resolve it
    here, with its Arrow schema; otherwise the schema is None); ``spread``: see :func:`cut_ranges`.
    """
    return _plan_file(path, tree, filter_name, resolved, mode, size, entry_start, entry_stop, spread=spread)[:5]


def _plan_file(path: str, tree: str, filter_name: list[str], resolved: Optional[list[str]], mode: str,
                        size: int, entry_start: Optional[int] = None, entry_stop: Optional[int] = None,
                        keep_chunk: bool = False, spread: int = 1):
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
    ranges = _ranges(t, by_name, resolved, mode, size, a, b, spread)
    if table is not None and (ranges != [(0, table.num_rows)] or table.num_rows == 0):
        table = None
    return t, resolved, max(0, b - a), ranges, schema, table


def plan_chunks(files: list[str], tree: str, filter_name: list[str], step_size: Union[int, str] = "100 MB",
                entry_start: Optional[int] = None, entry_stop: Optional[int] = None,
                progress: bool = True, stop_after_first_good: bool = False,
                file_timeout_s: Optional[float] = FILE_TIMEOUT_S, keep_first_chunk: bool = False,
                spread: int = 1, baskets: bool = False) -> Plan:
    """Open each file's tree metadata on the driver and cut it into chunks; bad files (also one
    that takes longer than ``file_timeout_s``) are recorded, not raised. The branch selection and
    the Arrow schema come from the first good file; with ``keep_first_chunk``, when that file is
    one chunk starting at entry 0, it is read whole for the schema and kept as ``first_table``.
    ``spread``: a file of several chunks is cut into a multiple of it (:func:`cut_ranges`). With
    ``baskets``, each chunk of a file of several chunks carries its basket map, so that the task
    reading it need not open the tree (:func:`~.baskets.basket_maps`)."""
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
                    keep_chunk=keep_first_chunk and resolved is None, spread=spread)
            if resolved is None:
                resolved, schema, first_table = branches, found, (table if keep_first_chunk else None)
            maps = basket_maps(t, branches, ranges) if baskets and len(ranges) > 1 else [None] * len(ranges)
            for (x, y), m in zip(ranges, maps):
                chunks.append(Chunk(len(chunks), i, path, tree, x, y, m))
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
    return task_frame(spark, [(c.chunk_id, c.file_index, c.path, c.tree, c.entry_start, c.entry_stop, c.baskets)
                              for c in chunks],
                      "chunk_id int, file_index int, path string, tree string, entry_start long, entry_stop long, "
                      "baskets binary", tasks)
