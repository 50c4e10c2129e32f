"""Flat and plain jagged branches read straight from their baskets in a local file.

uproot reads a basket through several layers of Python objects (a ``Chunk``, a ``Cursor``, a
``TBasket`` model, an interpretation's ``basket_array`` and ``final_array``): about 54 us per basket,
0.6 s of the 1.2 s it takes to read 50,000 entries of a CMS NanoAOD file's 1,120 flat branches
(10 baskets each), and as much for its 379 jagged ones. A flat branch (one number per entry:
:func:`~.trees.is_flat`) needs none of it: its basket on disk is a ``TKey`` header followed by the
entries' big-endian numbers, compressed in ROOT's blocks. :func:`read_flat` reads each basket with
one ``pread``, checks its header against the branch's own record (entries, byte count), inflates
its ZLIB blocks (ISA-L when installed, as uproot is set to) and converts the numbers with NumPy.
A jagged branch of numbers (:func:`is_plain_jagged`: a NanoAOD collection's member) has, after its
items, the basket's ``fEntryOffset`` array (a count, then each entry's byte position plus
``fKeylen``); :func:`read_jagged` turns it into the Arrow list array the awkward path gives.

The formats, as uproot 5 and ROOT define them:

* A basket's key: ``fNbytes`` (int32), the key version (int16), ``fObjlen`` (int32), ``fDatime``
  (uint32), ``fKeylen`` (int16), ``fCycle`` (int16), ...; its last 19 bytes are the ``TBasket``
  fields ``fVersion`` (uint16), ``fBufferSize``, ``fNevBufSize``, ``fNevBuf``, ``fLast`` (int32
  each) and a flag byte; the payload (``fNbytes - fKeylen`` bytes on disk, ``fObjlen`` inflated)
  follows. The entries' data are its first ``fLast - fKeylen`` bytes.
* A compressed payload is a series of blocks, each a 9-byte header (two letters naming the
  algorithm, a method byte, the compressed and the inflated size as 3-byte little-endian
  integers) and its bytes; ``ZL`` blocks are zlib streams.
* A jagged basket's entry offsets: the inflated payload's bytes from ``fLast - fKeylen`` on, big-
  endian int32, entries + 2 of them; uproot drops the first and replaces the last with the data's
  end.

Anything else (another algorithm, a basket embedded in the branch's metadata, a header that
disagrees with the branch, a block that does not inflate, a remote file) raises
:class:`NotDirect`, and the caller reads that branch with uproot, which reports a corrupt basket
as it always does (a jagged basket without stored offsets, which uproot reads through the counter
branch, is also left to it). ``tests/test_ingest_root_fastpath.py`` checks every flat branch of the real
samples, and of generated multi-basket files, against uproot's arrays.

Opening a tree costs uproot about 0.4 s for a NanoAOD file's 1,499 branches, in every Spark task
that reads a chunk of a large file. Where the file is planned, :func:`basket_maps` writes down
each chunk's :class:`Layout` of every branch read here (plain arrays: seeks, sizes, first entries
and entries of its baskets; the dtypes), with the file's size and modification time; the chunk's
task reads with :func:`read_mapped` and no uproot object, and opens the tree only for the other
branches (or the whole file, when it is not the file that was mapped).
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
from uproot.interpretation.jagged import AsJagged
from uproot.interpretation.numerical import AsDtype

from .deadline import ReadTimeout

log = logging.getLogger(__name__)

_KEY = struct.Struct(">ihiIhh")       # fNbytes, key version, fObjlen, fDatime, fKeylen, fCycle
_BASKET = struct.Struct(">Hiiii")     # fVersion, fBufferSize, fNevBufSize, fNevBuf, fLast
_BLOCK = 9


class NotDirect(Exception):
    """This branch (or file) is not read here: uproot reads it."""


def _inflate_fn() -> Callable[[bytes], bytes]:
    """ISA-L's ZLIB decompressor when installed, else zlib's (the same bytes out)."""
    try:
        from isal import isal_zlib

        return isal_zlib.decompress
    except ImportError:
        return zlib.decompress


_INFLATE = _inflate_fn()


def _inflate(payload: bytes, size: int) -> bytes:
    """A basket's payload of ROOT compression blocks, inflated to its ``size`` bytes."""
    parts, pos = [], 0
    while pos < len(payload):
        head = payload[pos:pos + _BLOCK]
        if len(head) < _BLOCK or head[:2] != b"ZL":
            raise NotDirect(f"compression {head[:2]!r}")
        c = head[3] | head[4] << 8 | head[5] << 16
        u = head[6] | head[7] << 8 | head[8] << 16
        try:
            block = _INFLATE(payload[pos + _BLOCK:pos + _BLOCK + c])
        except Exception as e:  # noqa: BLE001 - a corrupt block: uproot reads it and reports it
            raise NotDirect(f"a block does not inflate ({type(e).__name__})") from None
        if len(block) != u:
            raise NotDirect("a block's size differs from its header")
        parts.append(block)
        pos += _BLOCK + c
    out = b"".join(parts)
    if len(out) != size:
        raise NotDirect("the payload's size differs from the key")
    return out


def _basket(fd: int, seek: int, nbytes: int, entries: int) -> tuple[bytes, int, int]:
    """(inflated payload, its data bytes ``fLast - fKeylen``, ``fKeylen``) of one free basket,
    checked against the branch's record."""
    raw = os.pread(fd, nbytes, seek)
    if len(raw) != nbytes:
        raise NotDirect("a basket runs past the end of the file")
    total, _, objlen, _, keylen, _ = _KEY.unpack_from(raw, 0)
    if total != nbytes or keylen < _KEY.size + _BASKET.size + 1 or keylen > nbytes:
        raise NotDirect("a basket key differs from the branch's record")
    _, _, _, nev, last = _BASKET.unpack_from(raw, keylen - _BASKET.size - 1)
    border = last - keylen
    if nev != entries or not 0 <= border <= objlen:
        raise NotDirect("a basket header differs from the branch's record")
    payload = raw[keylen:]
    return (payload if len(payload) == objlen else _inflate(payload, objlen)), border, keylen


def _basket_data(fd: int, seek: int, nbytes: int, entries: int, itemsize: int) -> bytes:
    """The entries' bytes of one free basket of a flat branch."""
    payload, border, _ = _basket(fd, seek, nbytes, entries)
    if border != entries * itemsize:
        raise NotDirect("a basket's size differs from its entries")
    return payload[:border]


def _jagged_basket(fd: int, seek: int, nbytes: int, entries: int, itemsize: int) -> tuple[bytes, np.ndarray]:
    """(the items' bytes, each entry's first item and the end: entries + 1 offsets) of one free
    basket of a jagged branch, as uproot reads ``fEntryOffset``."""
    payload, border, keylen = _basket(fd, seek, nbytes, entries)
    if border == len(payload) or (len(payload) - border) % 4:
        raise NotDirect("a jagged basket without entry offsets")      # uproot takes the counter branch
    raw = np.frombuffer(payload, dtype=">i4", offset=border)
    if len(raw) != entries + 2:
        raise NotDirect("a jagged basket's offsets differ from its entries")
    byte_offsets = raw[1:].astype(np.int64) - keylen
    byte_offsets[-1] = border
    steps = np.diff(byte_offsets)
    if byte_offsets[0] != 0 or (steps < 0).any() or (byte_offsets % itemsize).any():
        raise NotDirect("a jagged basket's offsets are not its items'")
    return payload[:border], byte_offsets // itemsize


def local_path(tree) -> str:
    """The path of the tree's file when it is a local file this process can read, else NotDirect."""
    path = getattr(tree.file, "file_path", None)
    if not isinstance(path, str) or "://" in path or not os.path.isfile(path):
        raise NotDirect("not a local file")
    return path


def local_identity(path: str) -> Optional[tuple[int, int]]:
    """(size, modification time in ns) of a local file, what a map or a cached tree of it is valid
    for; None for a remote or missing one."""
    if "://" in path:
        return None
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_mtime_ns


def is_flat(interpretation) -> bool:
    """One number per entry (bool, integer, float): what :func:`read_flat` reads (uproot's
    ``AsDtype``, not its subclasses such as Float16 or Double32)."""
    if type(interpretation) is not AsDtype:
        return False
    dt = interpretation.to_dtype
    return dt.shape == () and dt.kind in "biuf" and dt.isnative


def is_plain_jagged(interpretation) -> bool:
    """Numbers per entry with no header bytes: what :func:`read_jagged` reads."""
    if type(interpretation) is not AsJagged or interpretation.header_bytes != 0:
        return False
    return is_flat(interpretation.content)


@dataclass(frozen=True)
class Layout:
    """Where one branch's entries lie in its file: the numbers' dtype on disk (``src``, big-endian)
    and in memory (``dst``), whether the branch is jagged, and its free baskets in entry order,
    each (seek, bytes on disk, first entry, entries)."""

    src: np.dtype
    dst: np.dtype
    jagged: bool
    baskets: Sequence


def _numbers(branch, jagged: Optional[bool] = None) -> tuple[np.dtype, np.dtype, bool]:
    """(dtype on disk, dtype in memory, jagged) of a flat or plain jagged branch with free baskets
    (of that kind, when ``jagged`` is given); NotDirect for any other branch."""
    interp = branch.interpretation
    if jagged is not True and is_flat(interp):
        numbers, jagged = interp, False
    elif jagged is not False and is_plain_jagged(interp):
        numbers, jagged = interp.content, True
    else:
        raise NotDirect("not a branch of plain numbers of that kind")
    if branch.embedded_baskets:
        raise NotDirect("embedded baskets")
    return np.dtype(numbers.from_dtype), np.dtype(numbers.to_dtype), jagged


def layout(branch, a: int, b: int, jagged: Optional[bool] = None) -> Layout:
    """The :class:`Layout` of an uproot branch (flat or plain jagged; ``jagged``: only that kind)
    with the baskets holding entries [a, b); NotDirect for any other branch."""
    src, dst, jagged = _numbers(branch, jagged)
    offsets = branch.entry_offsets
    if int(offsets[-1]) < b:
        raise NotDirect("entries outside the branch's baskets")
    seeks, sizes = branch.member("fBasketSeek"), branch.member("fBasketBytes")
    baskets = []
    for i in range(len(offsets) - 1):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        if hi > a and lo < b:
            baskets.append((int(seeks[i]), int(sizes[i]), lo, hi - lo))
    return Layout(src, dst, jagged, baskets)


def _basket_rows(branch) -> np.ndarray:
    """Every basket of a branch as int64 rows (seek, bytes on disk, first entry, entries)."""
    offsets = np.asarray(branch.entry_offsets, dtype=np.int64)
    n = len(offsets) - 1
    rows = np.empty((n, 4), dtype=np.int64)
    rows[:, 0] = branch.member("fBasketSeek")[:n]
    rows[:, 1] = branch.member("fBasketBytes")[:n]
    rows[:, 2], rows[:, 3] = offsets[:-1], np.diff(offsets)
    return rows


def _inside(baskets: Sequence, a: int, b: int) -> list:
    """The baskets holding entries of [a, b)."""
    return [x for x in baskets if x[2] + x[3] > a and x[2] < b]


def read_flat(tree, names: list[str], entry_start: int, entry_stop: int) -> tuple[dict, list[str]]:
    """({name: NumPy array of entries [entry_start, entry_stop)}, names left to uproot) for flat
    branches ``names`` of the uproot TTree ``tree`` (native byte order, the dtype uproot gives)."""
    return _each(tree, names, entry_start, entry_stop, jagged=False)


def read_jagged(tree, names: list[str], entry_start: int, entry_stop: int) -> tuple[dict, list[str]]:
    """({name: Arrow list array of entries [entry_start, entry_stop)}, names left to uproot) for
    branches ``names`` of numbers per entry (uproot's ``AsJagged(AsDtype)`` without header bytes:
    a NanoAOD collection's members), of the type the awkward path gives them
    (``list<item: T not null>``, 32-bit offsets)."""
    return _each(tree, names, entry_start, entry_stop, jagged=True)


def _each(tree, names: list[str], a: int, b: int, jagged: bool) -> tuple[dict, list[str]]:
    try:
        path = local_path(tree)
    except NotDirect:
        return {}, list(names)
    out: dict = {}
    rest: list[str] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for name in names:
            try:
                out[name] = read_layout(fd, layout(tree[name], a, b, jagged), a, b)
            except NotDirect:
                rest.append(name)
    finally:
        os.close(fd)
    return out, rest


def read_layout(fd: int, lay: Layout, a: int, b: int):
    """Entries [a, b) of a branch of the open file ``fd``: a NumPy array (flat) or an Arrow list
    array (jagged); NotDirect when a basket is not read here."""
    return (_read_jagged if lay.jagged else _read_flat)(fd, lay, a, b)


def _read_flat(fd: int, lay: Layout, a: int, b: int) -> np.ndarray:
    src, dst = lay.src, lay.dst
    if b <= a:
        return np.empty(0, dtype=dst)
    baskets = _inside(lay.baskets, a, b)
    if not baskets or baskets[0][2] > a or baskets[-1][2] + baskets[-1][3] < b:
        raise NotDirect("the baskets do not hold the entries")
    first = baskets[0][2]
    chunks = [_basket_data(fd, seek, size, n, src.itemsize) for seek, size, _, n in baskets]
    return np.frombuffer(b"".join(chunks), dtype=src)[a - first:b - first].astype(dst)


def _read_jagged(fd: int, lay: Layout, a: int, b: int):
    import pyarrow as pa

    src, dst = lay.src, lay.dst
    typ = pa.list_(pa.field("item", pa.from_numpy_dtype(dst), nullable=False))
    if b <= a:
        return pa.array([], type=typ)
    values, counts = [], []
    for seek, size, lo, n in _inside(lay.baskets, a, b):
        data, item_offsets = _jagged_basket(fd, seek, size, n, src.itemsize)
        la, lb = max(a, lo) - lo, min(b, lo + n) - lo
        i0, i1 = int(item_offsets[la]), int(item_offsets[lb])
        values.append(np.frombuffer(data, dtype=src)[i0:i1])
        counts.append(np.diff(item_offsets[la:lb + 1]))
    if sum(len(c) for c in counts) != b - a:
        raise NotDirect("the baskets do not hold the entries")
    flat = np.concatenate(values).astype(dst) if values else np.empty(0, dtype=dst)
    offsets = np.zeros(b - a + 1, dtype=np.int64)
    np.cumsum(np.concatenate(counts), out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise NotDirect("more items than 32-bit offsets hold")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat), type=typ)


#: a basket map's columns (:func:`basket_maps`), one row per branch: its name, kind and dtypes,
#: then a list per basket field of :attr:`Layout.baskets`
_MAP_FIELDS = ("name", "jagged", "src", "dst", "seek", "nbytes", "first", "entries")


def _map_schema(size: int, mtime_ns: int):
    import pyarrow as pa

    fields = [("name", pa.string()), ("jagged", pa.bool_()), ("src", pa.string()), ("dst", pa.string())]
    fields += [(n, pa.list_(pa.int64())) for n in _MAP_FIELDS[4:]]
    return pa.schema(fields, metadata={"size": str(size), "mtime_ns": str(mtime_ns)})


def basket_maps(tree, names: list[str], ranges: list[tuple[int, int]]) -> list[Optional[bytes]]:
    """For each entry range of ``ranges``, the :class:`Layout` of every branch of ``names`` that is
    read here (flat or plain jagged, free baskets, a local file), restricted to the baskets of that
    range, as Arrow IPC bytes of plain columns, with the file's size and modification time: what a
    task needs to read those branches (:func:`read_mapped`) without opening the file's tree, whose
    metadata takes uproot most of a second to read for a NanoAOD file's 1,499 branches. None for
    each range when no branch is read here."""
    import pyarrow as pa
    from uproot.behaviors.TBranch import HasBranches

    if not isinstance(tree, HasBranches):            # an RNTuple: its fields are read with uproot
        return [None] * len(ranges)
    try:
        ident = local_identity(local_path(tree))
    except NotDirect:
        ident = None
    if ident is None:
        return [None] * len(ranges)
    kinds, rows = {}, []
    for name in names:
        try:
            kind, where = _numbers(tree[name]), _basket_rows(tree[name])
        except NotDirect:
            continue
        except ReadTimeout:
            raise
        except Exception as e:  # noqa: BLE001 - a map only saves time: its task opens the tree instead
            log.info("no basket maps for %s (branch %r: %s)", local_path(tree), name, e)
            return [None] * len(ranges)
        kinds[name] = kind
        rows.append(where)
    if not kinds:
        return [None] * len(ranges)
    schema = _map_schema(*ident)
    fixed = [pa.array(list(kinds), pa.string()), pa.array([k[2] for k in kinds.values()], pa.bool_()),
             pa.array([k[0].str for k in kinds.values()], pa.string()),
             pa.array([k[1].str for k in kinds.values()], pa.string())]
    every = np.concatenate(rows)                                         # all branches' baskets, in order
    owner = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    out = []
    for a, b in ranges:
        inside = (every[:, 2] < b) & (every[:, 2] + every[:, 3] > a)
        counts = np.bincount(owner[inside], minlength=len(rows))
        offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
        chosen = every[inside]
        lists = [pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(chosen[:, i]))) for i in range(4)]
        batch = pa.RecordBatch.from_arrays(fixed + lists, schema=schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as w:
            w.write_batch(batch)
        out.append(sink.getvalue().to_pybytes())
    return out


def _parse_map(blob: bytes) -> tuple[dict, tuple[int, int]]:
    """({branch: Layout}, (file size, modification time in ns)) of a basket map."""
    import pyarrow as pa

    batch = pa.ipc.open_stream(pa.py_buffer(blob)).read_next_batch()
    meta = batch.schema.metadata or {}
    ident = (int(meta[b"size"]), int(meta[b"mtime_ns"]))
    names, jagged, src, dst = (batch.column(i).to_pylist() for i in range(4))
    offsets = batch.column(4).offsets.to_numpy()
    rows = np.stack([batch.column(4 + i).values.to_numpy() for i in range(4)], axis=1)
    lays = {}
    for i, name in enumerate(names):
        lays[name] = Layout(np.dtype(src[i]), np.dtype(dst[i]), jagged[i], rows[offsets[i]:offsets[i + 1]].tolist())
    return lays, ident


def read_mapped(path: str, blob: bytes, names: list[str], entry_start: int,
                entry_stop: int) -> tuple[dict, list[str]]:
    """({name: entries [entry_start, entry_stop)}: NumPy arrays of flat branches, Arrow lists of
    jagged ones; the names left to uproot, in their order) for ``names`` of the local file ``path``,
    read with the basket map ``blob`` of :func:`basket_maps` and no uproot object. Every name is
    left to uproot when the file is not the one mapped (another size or modification time)."""
    lays, ident = _parse_map(blob)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return {}, list(names)
    out: dict = {}
    try:
        if _identity(os.fstat(fd)) != ident:         # the open file itself: no race with a rename
            return {}, list(names)
        for name in names:
            if name in lays:
                try:
                    out[name] = read_layout(fd, lays[name], entry_start, entry_stop)
                except NotDirect:
                    pass
    finally:
        os.close(fd)
    return out, [n for n in names if n not in out]
