"""The shards' feature layout: one fixed-size binary tensor per row.

The shard stage writes each feature column (``image``, ``hlf``, ``llf`` by default) whose
rows are lists of one fixed length k as a Parquet ``FIXED_LEN_BYTE_ARRAY`` of k values of its
dtype, with field metadata ``{"pipeline.tensor": {"dtype": ..., "length": k}}``. Parquet then
stores no repetition levels and decoding a row group is a single buffer copy (list columns
decode element by element: docs/loader.md has the measured comparison). :func:`encode` is used
by the writer (:mod:`pipeline.shards.write`), :func:`decode` by the reader
(:mod:`pipeline.data.parquet`), which also reads plain list columns. A list column that declares
``pad_to`` (the LLF of schema v3 holds only real particles) becomes a tensor of that length,
each row padded with zeros.
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np

#: the feature columns written as tensors when present (ShardConfig.tensor_columns overrides)
TENSOR_COLUMNS = ("image", "hlf", "llf")
META_KEY = b"pipeline.tensor"


def is_numeric_list(t) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return False
    v = t.value_type
    return pa.types.is_integer(v) or pa.types.is_floating(v)


def tensor_field(name: str, dtype: str, length: int):
    """The Arrow field of a tensor column (fixed-size binary with the dtype/length metadata)."""
    import pyarrow as pa

    width = np.dtype(dtype).itemsize * int(length)
    return pa.field(name, pa.binary(width), nullable=False,
                    metadata={META_KEY: json.dumps({"dtype": dtype, "length": int(length)}).encode()})


def tensor_spec(field) -> Optional[tuple[str, int]]:
    """(dtype, length) of a tensor column's field, None for any other field."""
    md = field.metadata or {}
    if META_KEY not in md:
        return None
    d = json.loads(md[META_KEY])
    return str(d["dtype"]), int(d["length"])


def encode(arr, name: str, dtype: str, length: int, pad: bool = False):
    """A list column (Arrow array) -> fixed-size binary array; raises ValueError naming the
    column when a row is null or its list does not have ``length`` values. With ``pad`` (a
    column with ``pad_to``, :mod:`pipeline.schemas`) a list may be shorter and is padded with
    zeros; longer is still an error."""
    import pyarrow as pa

    buf = rows_array(arr, name, dtype, length, pad)
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(buf.itemsize * length), len(buf),
                                                [None, pa.py_buffer(buf)])


def rows_array(arr, name: str, dtype: str, length: int, pad: bool = False) -> np.ndarray:
    """A list column (Arrow array) -> ``(rows, length)`` C-contiguous array of ``dtype``, the
    checks and the zero padding of :func:`encode`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    if arr.null_count:
        raise ValueError(f"column {name!r} has {arr.null_count} null row(s)")
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64) if n else np.zeros(0, int)
    if n and (lengths.max() > length or (not pad and lengths.min() != length)):
        bad = int(lengths.max() if lengths.max() > length else lengths.min())
        raise ValueError(f"column {name!r} has a list of length {bad}, expected "
                         f"{'at most ' if pad else ''}{length}"
                         f"{' (pad_to)' if pad else ' (every row of a tensor column needs the same length)'}")
    values = arr.flatten()
    if values.null_count:
        raise ValueError(f"column {name!r} has null list elements")
    flat = values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    if pad and n and lengths.min() != length:
        buf = np.zeros((n, length), dtype)
        starts = np.cumsum(lengths) - lengths
        buf.reshape(-1)[np.repeat(np.arange(n, dtype=np.int64) * length - starts, lengths)
                        + np.arange(len(flat))] = flat
        return buf
    return np.ascontiguousarray(flat).reshape(n, length)


def decode(arr, dtype: str, length: int) -> np.ndarray:
    """A tensor column (fixed-size binary array) -> ``(rows, length)`` array (a view of its buffer)."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    width = arr.type.byte_width
    data = np.frombuffer(arr.buffers()[1], np.uint8)[arr.offset * width:(arr.offset + len(arr)) * width]
    return data.view(np.dtype(dtype)).reshape(len(arr), length)
