"""Flat branches read straight from their baskets in a local file.

uproot reads a basket through several layers of Python objects (a ``Chunk``, a ``Cursor``, a
``TBasket`` model, an interpretation's ``basket_array`` and ``final_array``): about 54 us per basket,
0.6 s of the 1.2 s it takes to read 50,000 entries of a CMS NanoAOD file's 1,120 flat branches
(10 baskets each). A flat branch (one number per entry: :func:`~.trees.is_flat`) needs none of it:
its basket on disk is a ``TKey`` header followed by the entries' big-endian numbers, compressed in
ROOT's blocks. :func:`read_flat` reads each basket with one ``pread``, checks its header against the
branch's own record (entries, byte count), inflates its ZLIB blocks with the decompressor uproot
uses, and converts the numbers with NumPy.

The formats, as uproot 5 and ROOT define them:

* A basket's key: ``fNbytes`` (int32), the key version (int16), ``fObjlen`` (int32), ``fDatime``
  (uint32), ``fKeylen`` (int16), ``fCycle`` (int16), ...; its last 19 bytes are the ``TBasket``
  fields ``fVersion`` (uint16), ``fBufferSize``, ``fNevBufSize``, ``fNevBuf``, ``fLast`` (int32
  each) and a flag byte; the payload (``fNbytes - fKeylen`` bytes on disk, ``fObjlen`` inflated)
  follows. The entries' data are its first ``fLast - fKeylen`` bytes.
* A compressed payload is a series of blocks, each a 9-byte header (two letters naming the
  algorithm, a method byte, the compressed and the inflated size as 3-byte little-endian
  integers) and its bytes; ``ZL`` blocks are zlib streams.

Anything else (another algorithm, a basket embedded in the branch's metadata, a header that
disagrees with the branch, a block that does not inflate, a remote file) raises
:class:`NotDirect`, and the caller reads that branch with uproot, which reports a corrupt basket
as it always does. ``tests/test_ingest_root_fastpath.py`` checks every flat branch of the real
samples, and of generated multi-basket files, against uproot's arrays.
"""
from __future__ import annotations

import os
import struct
import zlib
from typing import Callable

import numpy as np

_KEY = struct.Struct(">ihiIhh")       # fNbytes, key version, fObjlen, fDatime, fKeylen, fCycle
_BASKET = struct.Struct(">Hiiii")     # fVersion, fBufferSize, fNevBufSize, fNevBuf, fLast
_BLOCK = 9


class NotDirect(Exception):
    """This branch (or file) is not read here: uproot reads it."""


def _inflate_fn() -> Callable[[bytes], bytes]:
    """The ZLIB decompressor uproot is set to (ISA-L when installed: the same bytes out)."""
    try:
        from isal import isal_zlib

        return isal_zlib.decompress
    except ImportError:
        return zlib.decompress


def _inflate(payload: bytes, size: int, inflate) -> bytes:
    """A basket's payload of ROOT compression blocks, inflated to its ``size`` bytes."""
    parts, pos = [], 0
    while pos < len(payload):
        head = payload[pos:pos + _BLOCK]
        if len(head) < _BLOCK or head[:2] != b"ZL":
            raise NotDirect(f"compression {head[:2]!r}")
        c = head[3] | head[4] << 8 | head[5] << 16
        u = head[6] | head[7] << 8 | head[8] << 16
        try:
            block = inflate(payload[pos + _BLOCK:pos + _BLOCK + c])
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


def _basket_data(fd: int, seek: int, nbytes: int, entries: int, itemsize: int, inflate) -> bytes:
    """The entries' bytes of one free basket, checked against its header."""
    raw = os.pread(fd, nbytes, seek)
    if len(raw) != nbytes:
        raise NotDirect("a basket runs past the end of the file")
    total, _, objlen, _, keylen, _ = _KEY.unpack_from(raw, 0)
    if total != nbytes or keylen < _KEY.size + _BASKET.size + 1 or keylen > nbytes:
        raise NotDirect("a basket key differs from the branch's record")
    _, _, _, nev, last = _BASKET.unpack_from(raw, keylen - _BASKET.size - 1)
    border = last - keylen
    if nev != entries or border != entries * itemsize or border > objlen:
        raise NotDirect("a basket header differs from the branch's record")
    payload = raw[keylen:]
    data = payload if len(payload) == objlen else _inflate(payload, objlen, inflate)
    return data[:border]


def local_path(tree) -> str:
    """The path of the tree's file when it is a local file this process can read, else NotDirect."""
    path = getattr(tree.file, "file_path", None)
    if not isinstance(path, str) or "://" in path or not os.path.isfile(path):
        raise NotDirect("not a local file")
    return path


def read_flat(tree, names: list[str], entry_start: int, entry_stop: int) -> tuple[dict, list[str]]:
    """({name: NumPy array of entries [entry_start, entry_stop)}, names left to uproot) for flat
    branches ``names`` of the uproot TTree ``tree`` (native byte order, the dtype uproot gives)."""
    try:
        path = local_path(tree)
    except NotDirect:
        return {}, list(names)
    inflate = _inflate_fn()
    out: dict = {}
    rest: list[str] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for name in names:
            try:
                out[name] = _read_branch(fd, tree[name], entry_start, entry_stop, inflate)
            except NotDirect:
                rest.append(name)
    finally:
        os.close(fd)
    return out, rest


def _read_branch(fd: int, branch, a: int, b: int, inflate) -> np.ndarray:
    interp = branch.interpretation
    src, dst = np.dtype(interp.from_dtype), np.dtype(interp.to_dtype)
    if b <= a:
        return np.empty(0, dtype=dst)
    if branch.embedded_baskets:
        raise NotDirect("embedded baskets")
    offsets = branch.entry_offsets
    seeks, sizes = branch.member("fBasketSeek"), branch.member("fBasketBytes")
    chunks, first = [], None
    for i in range(len(offsets) - 1):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        if hi <= a or lo >= b:
            continue
        if first is None:
            first = lo
        chunks.append(_basket_data(fd, int(seeks[i]), int(sizes[i]), hi - lo, src.itemsize, inflate))
    if first is None or int(offsets[-1]) < b:
        raise NotDirect("entries outside the branch's baskets")
    values = np.frombuffer(b"".join(chunks), dtype=src)[a - first:b - first]
    return values.astype(dst)
