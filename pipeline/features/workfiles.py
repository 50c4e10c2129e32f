"""The work files of the feature stage: the selected events of one chunk (llf of the real
particles, n_particles, hlf, in event order), left by the feature task as one Arrow IPC file for
the writer tasks of the second pass.

They are written with the task attempt of the commit protocol (:mod:`pipeline.commit`), on the
output's filesystem under the job's prefix, and never committed: the commit (or the abort)
deletes them with the prefix. A writer task reads one at ``target.file(attempt_dir, name)``."""
from __future__ import annotations

import functools
from typing import Iterator

from ..fs import Location
from .rows import fixed_lists, llf_lists

#: rows per record batch of a work file: the writer holds one batch (about 16 MB) at a time
IPC_BATCH_ROWS = 256


def work_name(file_index: int, entry_start: int) -> str:
    """The work file of a chunk (its name inside the attempt's directory)."""
    return f"_work/chunk-{file_index:06d}-{entry_start:012d}.arrow"


@functools.lru_cache(maxsize=None)
def _ipc_options(compression: str):
    import pyarrow as pa
    return pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)


def save_block(block, sink, batch_rows: int = IPC_BATCH_ROWS, *, compression: str) -> None:
    """The selected events' llf (real particles, :func:`~pipeline.features.rows.llf_lists`),
    n_particles, hlf in event order, as one Arrow IPC file written to ``sink`` (a pyarrow output
    stream; ``compression``: none, lz4 or zstd buffers)."""
    import pyarrow as pa

    table = pa.table({"llf": llf_lists(block.llf, block.n_particles),
                      "n_particles": pa.array(block.n_particles, pa.int32()), "hlf": fixed_lists(block.hlf)})
    with pa.ipc.new_file(sink, table.schema, options=_ipc_options(compression)) as writer:
        writer.write_table(table, max_chunksize=batch_rows)


def read_batches(loc: Location) -> Iterator:
    """The record batches of one work file, in event order (read, not mapped: the rows outlive the
    file)."""
    import pyarrow as pa

    with loc.filesystem().open_input_file(loc.path) as src:
        reader = pa.ipc.open_file(src)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
