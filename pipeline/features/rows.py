"""The rows of ``hlf/`` and ``llf/``: their Arrow schema (``schemas/hlf`` v2, ``schemas/llf`` v3),
the Arrow columns built from numpy blocks, the Parquet writer options and the byte sizes that
set row groups and files."""
from __future__ import annotations

import numpy as np

from .layout import LLF_SIZE, N_HLF, N_LLF_FEATURES
from .split import SPLITS

#: the versions of schemas/hlf and schemas/llf the stage writes
SCHEMA_VERSIONS = {"hlf": 2, "llf": 3}
#: the float lists: snappy, no dictionary encoding and no statistics (their values rarely repeat,
#: and min/max over a list's elements help no reader)
_FLOAT_LISTS = ("hlf", "llf")
#: bytes of one written row (values only; an LLF row adds its list offset, n_particles and
#: 4 x 19 bytes per particle: :func:`llf_row_bytes`)
HLF_ROW_BYTES = 8 + 8 + 8 + 4 * N_HLF
_LLF_ROW_BASE = HLF_ROW_BYTES + 4 + 4


def output_schema(with_llf: bool):
    """The Arrow schema of hlf/ (``with_llf`` False) or llf/ rows (see ``schemas/hlf``, ``schemas/llf``)."""
    import pyarrow as pa

    cols = [pa.field("sample_id", pa.int64(), False), pa.field("label", pa.int64(), False),
            pa.field("split", pa.string(), False)]
    if with_llf:
        from ..schemas import PAD_KEY

        cols += [pa.field("llf", pa.list_(pa.float32()), False, metadata={PAD_KEY: str(LLF_SIZE).encode()}),
                 pa.field("n_particles", pa.int32(), False)]
    return pa.schema(cols + [pa.field("hlf", pa.list_(pa.float32()), False)])


def parquet_options(schema) -> dict:
    """pyarrow Parquet writer options of hlf/ and llf/: snappy; dictionaries and statistics for the
    plain columns only."""
    plain = [f.name for f in schema if f.name not in _FLOAT_LISTS]
    return {"compression": "snappy", "use_dictionary": plain, "write_statistics": plain}


def rows_per_group(row_group_mb: float, row_bytes: int) -> int:
    return max(1, int(row_group_mb * (1 << 20)) // row_bytes)


def llf_row_bytes(n_particles) -> np.ndarray:
    """Bytes of values of each llf/ row with these numbers of real particles."""
    return _LLF_ROW_BASE + 4 * N_LLF_FEATURES * np.asarray(n_particles, np.int64)


def fixed_lists(x: np.ndarray):
    """A list<float> column from an ``(n, w)`` block: one row of ``w`` values each."""
    import pyarrow as pa

    n, w = x.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * w, pa.int32()),
                                    pa.array(np.ascontiguousarray(x, np.float32).reshape(-1), pa.float32()))


def llf_lists(llf: np.ndarray, n_particles: np.ndarray):
    """The ``llf`` column of schema v3 from padded ``(k, LLF_SIZE)`` blocks: each event's first
    ``n_particles`` rows of 19 features (its real particles), flattened particle-major."""
    import pyarrow as pa

    width = np.asarray(n_particles, np.int64) * N_LLF_FEATURES
    x = np.asarray(llf, np.float32).reshape(len(width), LLF_SIZE)
    # slices of the real rows only: the zero padding (most of the block, mostly never touched) is not read
    values = (np.concatenate([x[i, :w] for i, w in enumerate(width.tolist())]) if len(width)
              else np.zeros(0, np.float32))
    offsets = np.zeros(len(width) + 1, np.int32)
    np.cumsum(width, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.float32()))


def split_names(codes: np.ndarray):
    """The ``split`` column from split indices (into :data:`~pipeline.features.split.SPLITS`)."""
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int8()), pa.array(SPLITS)).cast(pa.string())


def write_rows(path: str, block, sample_id: np.ndarray, label: np.ndarray, split: np.ndarray, with_llf: bool,
               row_group_mb: float) -> None:
    """One Parquet file of hlf/ (``with_llf`` False) or llf/ rows of a block of selected events
    (``block.hlf``, ``block.llf``, ``block.n_particles``), with the stage's writer options and a
    row group size from the mean row size: the rows as the stage writes them, for measuring."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = len(sample_id)
    cols = {"sample_id": pa.array(np.asarray(sample_id, np.int64)), "label": pa.array(np.asarray(label, np.int64)),
            "split": split_names(np.asarray(split, np.int8))}
    if with_llf:
        cols |= {"llf": llf_lists(block.llf, block.n_particles), "n_particles": pa.array(block.n_particles, pa.int32())}
        row_bytes = int(llf_row_bytes(block.n_particles).mean()) if k else 1
    else:
        row_bytes = HLF_ROW_BYTES
    schema = output_schema(with_llf)
    table = pa.table({**cols, "hlf": fixed_lists(block.hlf)}, schema=schema)
    pq.write_table(table, path, row_group_size=rows_per_group(row_group_mb, row_bytes), **parquet_options(schema))
