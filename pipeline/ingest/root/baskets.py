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
"""
from __future__ import annotations

import os
import struct
import zlib
from typing import Callable, Optional

import numpy as np

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


def read_flat(tree, names: list[str], entry_start: int, entry_stop: int) -> tuple[dict, list[str]]:
    """({name: NumPy array of entries [entry_start, entry_stop)}, names left to uproot) for flat
    branches ``names`` of the uproot TTree ``tree`` (native byte order, the dtype uproot gives)."""
    return _each(tree, names, lambda fd, b: _read_flat(fd, b, entry_start, entry_stop))


def read_jagged(tree, names: list[str], entry_start: int, entry_stop: int) -> tuple[dict, list[str]]:
    """({name: Arrow list array of entries [entry_start, entry_stop)}, names left to uproot) for
    branches ``names`` of numbers per entry (uproot's ``AsJagged(AsDtype)`` without header bytes:
    a NanoAOD collection's members), of the type the awkward path gives them
    (``list<item: T not null>``, 32-bit offsets)."""
    return _each(tree, names, lambda fd, b: _read_jagged(fd, b, entry_start, entry_stop))


def is_plain_jagged(interpretation) -> bool:
    """Numbers per entry with no header bytes: what :func:`read_jagged` reads."""
    from uproot.interpretation.jagged import AsJagged
    from uproot.interpretation.numerical import AsDtype

    if type(interpretation) is not AsJagged or interpretation.header_bytes != 0:
        return False
    content = interpretation.content
    if type(content) is not AsDtype:
        return False
    dt = content.to_dtype
    return dt.shape == () and dt.kind in "biuf" and dt.isnative


def _each(tree, names: list[str], read) -> tuple[dict, list[str]]:
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
                out[name] = read(fd, tree[name])
            except NotDirect:
                rest.append(name)
    finally:
        os.close(fd)
    return out, rest


def _baskets(branch, a: int, b: int) -> tuple[list[tuple[int, int, int, int]], Optional[int]]:
    """The free baskets holding entries [a, b): (seek, bytes, first entry, entries) each."""
    if branch.embedded_baskets:
        raise NotDirect("embedded baskets")
    offsets = branch.entry_offsets
    if int(offsets[-1]) < b:
        raise NotDirect("entries outside the branch's baskets")
    seeks, sizes = branch.member("fBasketSeek"), branch.member("fBasketBytes")
    out = []
    for i in range(len(offsets) - 1):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        if hi > a and lo < b:
            out.append((int(seeks[i]), int(sizes[i]), lo, hi - lo))
    return out, (out[0][2] if out else None)


def _read_flat(fd: int, branch, a: int, b: int) -> np.ndarray:
    interp = branch.interpretation
    src, dst = np.dtype(interp.from_dtype), np.dtype(interp.to_dtype)
    if b <= a:
        return np.empty(0, dtype=dst)
    baskets, first = _baskets(branch, a, b)
    chunks = [_basket_data(fd, seek, size, n, src.itemsize) for seek, size, _, n in baskets]
    return np.frombuffer(b"".join(chunks), dtype=src)[a - first:b - first].astype(dst)


def _read_jagged(fd: int, branch, a: int, b: int):
    import pyarrow as pa

    content = branch.interpretation.content
    src, dst = np.dtype(content.from_dtype), np.dtype(content.to_dtype)
    typ = pa.list_(pa.field("item", pa.from_numpy_dtype(dst), nullable=False))
    if b <= a:
        return pa.array([], type=typ)
    values, counts = [], []
    for seek, size, lo, n in _baskets(branch, a, b)[0]:
        data, item_offsets = _jagged_basket(fd, seek, size, n, src.itemsize)
        la, lb = max(a, lo) - lo, min(b, lo + n) - lo
        i0, i1 = int(item_offsets[la]), int(item_offsets[lb])
        values.append(np.frombuffer(data, dtype=src)[i0:i1])
        counts.append(np.diff(item_offsets[la:lb + 1]))
    flat = np.concatenate(values).astype(dst) if values else np.empty(0, dtype=dst)
    offsets = np.zeros(b - a + 1, dtype=np.int64)
    np.cumsum(np.concatenate(counts), out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise NotDirect("more items than 32-bit offsets hold")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat), type=typ)
