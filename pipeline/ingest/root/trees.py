"""Opening a TTree or RNTuple with uproot and reading entry ranges of its branches as Arrow.

:func:`read_arrow` is the read every task does. A flat numeric branch (one number per entry: 1,120
of a CMS NanoAOD file's 1,499) is read as a NumPy array, straight from its baskets in a local file
(:mod:`.baskets`; else uproot's ``library="np"``), and wrapped as an Arrow array without a copy,
instead of a detour through an awkward array per branch; so is a branch of numbers per entry (a
NanoAOD collection's member), as an Arrow list array; every other branch
(jagged, fixed-size, objects, an RNTuple's fields) goes uproot -> awkward -> Arrow
(:func:`to_arrow`). Plain branches take their interpretation from the ones this worker found for
the same leaf before (:func:`~pipeline.ingest.uproot_adapter.reuse_interpretations`), and ZLIB
baskets are decompressed with ISA-L when it is installed
(:func:`~pipeline.ingest.uproot_adapter.use_fast_zlib`); class names met while reading a TTree's
metadata are regularised once (:func:`~pipeline.ingest.uproot_adapter.memoize_classnames`). The
columns and their Arrow types are the same either way (``tests/test_ingest_root_fastpath.py``).
:func:`read_arrow_mapped` is the same read of a chunk whose basket map the planner made: it
opens the tree only for the branches the map does not hold."""
from __future__ import annotations

import fnmatch
import glob
import re
from typing import Optional

from ...errors import BadInputError
from ...fs import open_root
from ..uproot_adapter import (index_nested_branches, index_rntuple_fields, memoize_classnames, reuse_interpretations,
                              use_fast_zlib)
from .baskets import is_flat, is_plain_jagged, local_identity, read_flat, read_jagged, read_mapped
from .config import FILE_TIMEOUT_S
from .deadline import ReadTimeout, read_deadline


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters)."""
    return (str(e).strip().splitlines() or [""])[0][:300]


def error_text(e: BaseException) -> str:
    """The one-line reason a file failed: our own messages as they are, others with their type."""
    return str(e) if isinstance(e, (BadInputError, ReadTimeout)) else f"{type(e).__name__}: {first_line(e)}"


def is_rntuple(t) -> bool:
    from uproot.behaviors.RNTuple import RNTuple

    return isinstance(t, RNTuple)


_ZLIB: list = []


def open_tree(path: str, tree: str):
    """Open ``path`` and return its TTree or RNTuple ``tree``, or raise BadInputError(reason)."""
    if not _ZLIB:                                   # once per worker process
        _ZLIB.append(use_fast_zlib())
        memoize_classnames()
    try:
        f = open_root(path)
    except FileNotFoundError:
        raise BadInputError("cannot open file: no such file") from None
    except ReadTimeout:
        raise
    except Exception as e:  # uproot raises many types for a corrupt file
        raise BadInputError(f"cannot open file: {type(e).__name__}: {first_line(e)}") from None
    try:
        t = f[tree]
    except ReadTimeout:
        raise
    except Exception as e:
        raise BadInputError(f"no tree {tree!r} in the file ({first_line(e)})") from None
    if not hasattr(t, "num_entries") or not hasattr(t, "arrays"):
        raise BadInputError(f"{tree!r} is a {type(t).__name__}, not a TTree or an RNTuple")
    if is_rntuple(t):
        index_rntuple_fields(t)
    else:
        index_nested_branches(t)
    return t


_OPEN: dict = {}


def cached_tree(path: str, tree: str, scope: Optional[str] = None):
    """The last opened tree of this Python worker (chunks of one file often share a worker), kept
    for one ``scope`` (the job: a worker outlives it) and, for a local file, while its size and
    modification time stay the same (a file rewritten in place is opened anew)."""
    key = (path, tree, scope, local_identity(path))
    if key not in _OPEN:
        _OPEN.clear()
        _OPEN[key] = open_tree(path, tree)
    return _OPEN[key]


def branches_by_name(t) -> dict:
    """Every branch by its name without the parent's path (``Electron.PT``, not
    ``Electron/Electron.PT``), from one walk of the branch tree (``t[name]`` searches the tree
    recursively for every name). For an RNTuple: its top-level fields."""
    if is_rntuple(t):
        return {name: t[name] for name in t.keys(recursive=False)}
    return dict(t.iteritems(recursive=True, full_paths=False))


def match_branches(patterns: list[str], names: list[str]) -> tuple[list[str], list[str]]:
    """uproot ``filter_name`` semantics over ``names``: (matched names in tree order, exact names
    that are missing). Exact names first (``Jet.FracPt[5]`` is not a glob), then ``/regex/`` and globs."""
    chosen: set[str] = set()
    missing = []
    name_set = set(names)
    for pat in patterns:
        if pat in name_set:
            chosen.add(pat)
        elif len(pat) > 1 and pat.startswith("/") and pat.endswith("/"):
            rx = re.compile(pat[1:-1])
            chosen.update(n for n in names if rx.search(n))
        elif glob.has_magic(pat):
            chosen.update(fnmatch.filter(names, pat))
        else:
            missing.append(pat)
    return [n for n in names if n in chosen], missing


def read_arrays(t, branches: list[str], entry_start: int, entry_stop: int):
    """The ``branches`` of entries [entry_start, entry_stop) of a TTree or RNTuple, in that order
    (an RNTuple read of a cardinality field also returns its ``_collectionN``: dropped)."""
    arr = t.arrays(branches, entry_start=entry_start, entry_stop=entry_stop, library="ak")
    return arr if arr.fields == branches else arr[branches]


#: the interpretations of plain branches this worker identified, by what they depend on (the files
#: of one run share them; bounded by the distinct leaf descriptions seen)
_PLANS: dict = {}
_PLANS_MAX = 100_000


def read_arrow(t, branches: list[str], entry_start: int, entry_stop: int, direct: bool = True):
    """The ``branches`` of entries [entry_start, entry_stop) as a pyarrow Table (the columns and
    types of ``to_arrow(read_arrays(...))``): flat numeric branches through NumPy, the others
    through awkward; with ``direct`` (the default), flat and plain jagged branches of a local file
    straight from their baskets (:mod:`.baskets`; ``direct=False`` measures uproot's own read)."""
    if is_rntuple(t):
        return to_arrow(read_arrays(t, branches, entry_start, entry_stop))
    if len(_PLANS) > _PLANS_MAX:
        _PLANS.clear()
    reuse_interpretations(t, branches, _PLANS)
    flat = [n for n in branches if is_flat(t[n].interpretation)]
    cols: dict = {}
    if flat:
        arrays, rest_flat = read_flat(t, flat, entry_start, entry_stop) if direct else ({}, flat)
        if rest_flat:
            arrays.update(t.arrays(rest_flat, entry_start=entry_start, entry_stop=entry_stop, library="np"))
        cols.update(_columns((n, arrays[n]) for n in flat))
    jagged = [n for n in branches if direct and n not in cols and is_plain_jagged(t[n].interpretation)]
    if jagged:
        lists, _ = read_jagged(t, jagged, entry_start, entry_stop)
        cols.update(_columns(lists.items()))
    rest = [n for n in branches if n not in cols]
    if rest:
        table = to_arrow(read_arrays(t, rest, entry_start, entry_stop))
        for i, n in enumerate(rest):
            cols[n] = (table.schema.field(i), table.column(i))
    return _table(branches, cols)


def read_arrow_mapped(path: str, tree: str, branches: list[str], entry_start: int, entry_stop: int, baskets: bytes,
                      scope: Optional[str] = None):
    """:func:`read_arrow`'s table of the ``branches`` of entries [entry_start, entry_stop) of
    ``path``, the branches of the basket map ``baskets`` (:func:`~.baskets.basket_maps`, made where
    the file was planned) read without opening the tree; the tree (this worker's
    :func:`cached_tree` for ``scope``) is opened only for the others."""
    got, rest = read_mapped(path, baskets, branches, entry_start, entry_stop)
    cols = _columns(got.items())
    if rest:
        table = read_arrow(cached_tree(path, tree, scope), rest, entry_start, entry_stop)
        cols.update((n, (table.schema.field(i), table.column(i))) for i, n in enumerate(rest))
    return _table(branches, cols)


def _columns(items) -> dict:
    """{name: (field, Arrow array)} of branches read as NumPy or Arrow arrays (never null)."""
    import pyarrow as pa

    out = {}
    for name, values in items:
        a = values if isinstance(values, pa.Array) else pa.array(values)
        out[name] = (pa.field(name, a.type, nullable=False), a)
    return out


def _table(branches: list[str], cols: dict):
    import pyarrow as pa

    return pa.Table.from_arrays([cols[n][1] for n in branches], schema=pa.schema([cols[n][0] for n in branches]))


def read_chunk(path: str, tree: str, branches: list[str], entry_start: int, entry_stop: int,
               timeout_s: Optional[float] = FILE_TIMEOUT_S, scope: Optional[str] = None):
    """uproot -> awkward record array of one entry range (:class:`ReadTimeout` after ``timeout_s``);
    ``scope``: see :func:`cached_tree`."""
    with read_deadline(timeout_s):
        return read_arrays(cached_tree(path, tree, scope), branches, entry_start, entry_stop)


def to_arrow(arr):
    """awkward record array -> pyarrow Table with plain (non-extension) types and 32-bit offsets."""
    import awkward as ak

    table = ak.to_arrow_table(arr, extensionarray=False, list_to32=True, string_to32=True)
    return table.replace_schema_metadata(None)
