"""Plan the file in the task, then a second pass for the large files: the pattern ROOT ingestion
and the feature stage share (the feature stage imports it from :mod:`pipeline.ingest.root`, the
package's public API; the task bodies, writers and reports stay with each stage).

Opening a ROOT file's metadata (a Delphes file: about 1,100 branch objects) costs several times
more than reading its physics branches, so it is done once per file, in parallel, in the task
that reads the file, not serially on the driver:

1. **First pass, one unit per file** (:func:`scan_file`, in a task): open the tree, check the
   branches, cut the entry ranges (:func:`~pipeline.ingest.root.planning.plan_file`); a file that
   is one range (the usual case) is read right there, on the open tree, with the stage's
   ``read(tree, entry_start, entry_stop)``. All of it within ``timeout_s``.
2. **On the driver** (:func:`second_pass_chunks`): the ranges of the files the first pass only
   planned become chunks.
3. **Second pass, one unit per chunk** (:func:`read_range`, in a task): ``read`` on the worker's
   cached tree of the file (kept for one job), within ``timeout_s``; or the stage's ``read_at``,
   which opens the tree only if it needs it (ingestion reads from the range's basket map, the
   first pass's ``describe`` of the range).

``read`` holds the stage's work on the input (reading, converting, computing); its exceptions make
the file a bad file (one line, its reason). The stage writes the result itself, after these
functions return: a write that fails (a full disk, the object store) fails the task, it is not the
input file's fault.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from .config import FILE_TIMEOUT_S, parse_step_size
from .deadline import read_deadline
from .planning import Chunk, plan_file
from .trees import cached_tree, error_text

#: the stage's work on one entry range of an open tree: ``read(tree, entry_start, entry_stop)``
Read = Callable[[Any, int, int], Any]


@dataclass(frozen=True)
class FilePlanning:
    """How a task plans a file (picklable): the tree, the branch selection fixed for every file
    (``branches``; ``filter_name`` is checked against the file), the chunk size and entry window,
    the time limit, and ``spread``: a file of several chunks is cut into a multiple of it
    (:func:`~pipeline.ingest.root.planning.cut_ranges`)."""

    tree: str
    branches: list[str]
    step_size: Union[int, str]
    filter_name: Optional[list[str]] = None
    entry_start: Optional[int] = None
    entry_stop: Optional[int] = None
    timeout_s: Optional[float] = FILE_TIMEOUT_S
    spread: int = 1


@dataclass
class FileScan:
    """The first pass over one file: its entries in the window, its ranges, the result of ``read``
    when the file is one range (``done``), or the reason it failed."""

    entries: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)
    done: bool = False
    data: Any = None
    error: Optional[str] = None
    notes: list = field(default_factory=list)


#: the stage's note on each range of a file of several ranges, for the second pass:
#: ``describe(tree, ranges)`` -> one small picklable value per range
Describe = Callable[[Any, list], list]


def scan_file(path: str, planning: FilePlanning, read: Optional[Read] = None,
              describe: Optional[Describe] = None) -> FileScan:
    """First pass over the file ``path`` (in a task): plan it and, when it is at most one range,
    ``read`` that range on the open tree (``done``; ``data`` is None for an empty window); when it
    is several, ``describe`` them on the open tree (``notes``: what the second pass's tasks need to
    know of the file, such as ingestion's basket maps)."""
    mode, size = parse_step_size(planning.step_size)
    scan = FileScan()
    try:
        with read_deadline(planning.timeout_s):
            t, _, scan.entries, scan.ranges, _ = plan_file(
                path, planning.tree, planning.filter_name or planning.branches, planning.branches, mode, size,
                planning.entry_start, planning.entry_stop, planning.spread)
            if len(scan.ranges) <= 1:
                scan.done = True
                if scan.ranges and read is not None:
                    scan.data = read(t, *scan.ranges[0])
            elif describe is not None:
                scan.notes = list(describe(t, scan.ranges))
    except Exception as e:  # noqa: BLE001 - the driver reports the file
        return FileScan(error=error_text(e))
    return scan


def second_pass_chunks(files: list[str], tree: str, scans: dict[int, tuple[list[int], list[int]]],
                       notes: Optional[dict[int, list]] = None) -> list[Chunk]:
    """The chunks of the files the first pass only planned: ``scans`` maps a file index to its
    (starts, stops), ``notes`` to its ranges' basket maps (:attr:`FileScan.notes`, when made);
    chunk ids follow the file order, then the entry order."""
    chunks: list[Chunk] = []
    for fi in sorted(scans):
        starts, stops = scans[fi]
        maps = list((notes or {}).get(fi) or [])
        maps = maps if len(maps) == len(starts) else [None] * len(starts)
        for a, b, m in zip(starts, stops, maps):
            chunks.append(Chunk(len(chunks), fi, files[fi], tree, int(a), int(b), bytes(m) if m is not None else None))
    return chunks


def read_range(path: str, tree: str, entry_start: int, entry_stop: int, read: Read,
               timeout_s: Optional[float] = FILE_TIMEOUT_S, scope: Optional[str] = None,
               read_at: Optional[Callable[[int, int], Any]] = None) -> tuple[Any, Optional[str]]:
    """Second pass over one chunk (in a task): (``read`` of the range on the worker's cached tree,
    None) or (None, the reason it failed). ``scope``: the job, for which alone the worker keeps
    the tree (:func:`~pipeline.ingest.root.trees.cached_tree`). ``read_at(entry_start,
    entry_stop)``, when given, is used instead: a read that opens the tree itself, only if it needs
    it (ingestion with a basket map)."""
    try:
        with read_deadline(timeout_s):
            if read_at is not None:
                return read_at(entry_start, entry_stop), None
            return read(cached_tree(path, tree, scope), entry_start, entry_stop), None
    except Exception as e:  # noqa: BLE001 - the driver reports the file
        return None, error_text(e)
