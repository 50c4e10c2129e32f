"""Shard Parquet files for the loader: listing, opening and decoding without per-row Python work.

A shard is a local directory or an object-store prefix (``s3://bucket/key``): a remote shard's
Parquet files are listed and read in place through :mod:`pyarrow.fs` (:mod:`pipeline.fs` gives
the filesystem; row groups are fetched by range requests), a local one is opened by path, so the
two give the same batches and the local path pays nothing extra.

Decoding: a tensor column of the shards (:mod:`pipeline.shards.tensors`) is one buffer copy; a
list column of fixed length becomes one ``(rows, length)`` array from its values buffer; a list
column that declares ``pad_to`` is zero-padded to that length.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..errors import BadInputError
from ..committed import committed_files
from ..fs import is_dir, location
from ..schemas import pad_length
from ..shards.tensors import decode, rows_array, tensor_spec


@dataclass(frozen=True)
class RowGroup:
    file: str
    index: int
    rows: int


def parquet_files(path: str) -> list[str]:
    """The shard's Parquet files, sorted (names starting with ``.`` or ``_`` skipped): local paths,
    or ``s3://`` URIs for a shard on an object store. A shard inside a committed output is the
    files its ``_COMPLETE`` marker lists (:func:`pipeline.committed.committed_files`: nothing put
    beside them is read). ``path`` may also name one file."""
    loc = location(path)
    if (Path(loc.path).is_dir() if loc.is_local else is_dir(loc)):
        files = [str(f) for f in committed_files(loc, ".parquet", "shard")]
    else:
        files = [str(loc)]
    if not files:
        raise BadInputError(f"{loc}: no Parquet files")
    return files


def _source(f: str) -> tuple:
    """``(path, filesystem)`` for pyarrow: a local file as it is, with no filesystem (pyarrow opens
    it itself: the fast path); an object-store file as its bucket/key and its pyarrow.fs filesystem."""
    if "://" not in f:
        return f, None
    loc = location(f)
    return loc.path, loc.filesystem()


def open_parquet(f: str):
    """``pq.ParquetFile`` of a local or object-store file (remote: the column chunks of a read
    fetched together)."""
    import pyarrow.parquet as pq

    path, fs = _source(f)
    return pq.ParquetFile(path, filesystem=fs, pre_buffer=fs is not None)


def read_parquet_table(f: str, columns: Sequence[str]):
    """The selected columns of one Parquet file, local or on an object store."""
    import pyarrow.parquet as pq

    path, fs = _source(f)
    return pq.read_table(path, columns=list(columns), use_threads=True, filesystem=fs)


def read_parquet_schema(f: str):
    import pyarrow.parquet as pq

    path, fs = _source(f)
    return pq.read_schema(path, filesystem=fs)


def file_stamp(f: str) -> tuple:
    """(file, mtime, size): what tells a changed file from the one cached."""
    path, fs = _source(f)
    if fs is None:
        st = os.stat(path)
        return f, st.st_mtime_ns, st.st_size
    info = fs.get_file_info(path)
    return f, info.mtime_ns, info.size


def row_groups(path: str) -> list[RowGroup]:
    """Every non-empty row group of the directory, in file order."""
    out = []
    for f in parquet_files(path):
        md = open_parquet(f).metadata
        out += [RowGroup(f, i, md.row_group(i).num_rows) for i in range(md.num_row_groups)
                if md.row_group(i).num_rows]
    return out


def decoded_bytes(path: str, columns: Sequence[str]) -> int:
    """Uncompressed size of the selected columns, from the Parquet footers (no data read)."""
    total = 0
    for f in parquet_files(path):
        md = open_parquet(f).metadata
        names = [md.schema.column(j).path.split(".")[0] for j in range(md.num_columns)]
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            total += sum(rg.column(j).total_uncompressed_size for j, n in enumerate(names) if n in columns)
    return total


def decode_column(arr, name: str, where: str, pad: Optional[int] = None) -> np.ndarray:
    """One Arrow column -> numpy without per-row work: scalars as they are, a list column whose
    lists all have the same length k as a ``(rows, k)`` array of its values; with ``pad`` (the
    column's ``pad_to``) lists of at most that length as ``(rows, pad)``, zero-padded."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if arr.null_count:
        raise BadInputError(f"{where}: column {name!r} has {arr.null_count} null value(s)")
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        return np.asarray(arr.flatten().to_numpy(zero_copy_only=False)).reshape(len(arr), t.list_size)
    if pad is not None and (pa.types.is_list(t) or pa.types.is_large_list(t)):
        try:
            return rows_array(arr, name, t.value_type.to_pandas_dtype().__name__, pad, pad=True)
        except ValueError as e:
            raise BadInputError(f"{where}: {e}") from None
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        n = len(arr)
        if n == 0:
            return np.zeros((0, 0), dtype=t.value_type.to_pandas_dtype())
        lengths = pc.list_value_length(arr)
        mm = pc.min_max(lengths).as_py()
        if mm["min"] != mm["max"]:
            raise BadInputError(f"{where}: column {name!r} has lists of lengths {mm['min']}..{mm['max']}; "
                                "the reader needs one length per column")
        values = arr.flatten()
        if values.null_count:
            raise BadInputError(f"{where}: column {name!r} has null list elements")
        return np.asarray(values.to_numpy(zero_copy_only=False)).reshape(n, mm["max"])
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def decode_table(table, columns: Sequence[str], where: str) -> dict:
    """``{column: torch tensor}`` of an Arrow table (copies into writable, torch-owned memory).
    Tensor columns (:mod:`pipeline.shards.tensors`) are one buffer copy; list columns are
    flattened (:func:`decode_column`)."""
    import torch

    out = {}
    for c in columns:
        f = table.schema.field(c)
        spec = tensor_spec(f)
        x = decode(table.column(c), *spec) if spec else decode_column(table.column(c), c, where, pad_length(f))
        out[c] = torch.from_numpy(np.array(x, copy=True))
    return out
