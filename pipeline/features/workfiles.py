"""The work files of the feature stage: the selected events of one chunk (llf of the real
particles, n_particles, hlf, in event order), left by the feature task as one Arrow IPC file for
the writer tasks of the second pass."""
from __future__ import annotations

import functools
import os
from typing import Iterator

from .rows import fixed_lists, llf_lists

#: rows per record batch of a work file: the writer holds one batch (about 16 MB) at a time
IPC_BATCH_ROWS = 256


def work_name(file_index: int, entry_start: int) -> str:
    """The work file (in the work directory) where the feature task of a chunk leaves its selected
    events for the writers."""
    return f"chunk-{file_index:06d}-{entry_start:012d}.arrow"


@functools.lru_cache(maxsize=None)
def _ipc_options(compression: str):
    import pyarrow as pa
    return pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)


def save_block(block, path: str, batch_rows: int = IPC_BATCH_ROWS, *, compression: str) -> None:
    """The selected events' llf (real particles, :func:`~pipeline.features.rows.llf_lists`),
    n_particles, hlf in event order, as one Arrow IPC file (``compression``: none, lz4 or zstd
    buffers), written under a hidden temporary name (removed if the write fails) and renamed, so a
    retried task never leaves half a file."""
    import pyarrow as pa

    table = pa.table({"llf": llf_lists(block.llf, block.n_particles),
                      "n_particles": pa.array(block.n_particles, pa.int32()), "hlf": fixed_lists(block.hlf)})
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    options = _ipc_options(compression)
    try:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema, options=options) as writer:
            writer.write_table(table, max_chunksize=batch_rows)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_batches(path: str) -> Iterator:
    """The record batches of one work file, in event order (read, not mapped: the rows outlive the
    file)."""
    import pyarrow as pa

    with pa.OSFile(path) as src:
        reader = pa.ipc.open_file(src)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
