"""The Petastorm engine (``loader.engine: petastorm``): a worker's shard read by Petastorm's
``make_batch_reader``, batched like the native streaming engine.

Petastorm reads the shard's row groups (local or ``s3://``, :mod:`pipeline.data.petastorm_fs`) and
hands each one over as numpy columns; the fixed-size binary tensor columns
(:mod:`pipeline.shards.tensors`) arrive as one ``bytes`` value per row and are decoded here in
numpy (one join and one ``frombuffer`` per row group). A ``TransformSpec`` doing the same decode
inside Petastorm's worker costs a pandas round trip per row group (Arrow -> pandas -> per-row
arrays -> Arrow -> numpy) and reads fewer rows per second (``bench/loader.py --profile``;
docs/loader.md).

What keeps the native engines' contracts:

* the row-group order is drawn by Petastorm from the epoch seed (``seed``, ``shuffle_row_groups``;
  ``shuffle=False``: file order), and exactly one reader thread (``reader_pool_type='thread'``,
  ``workers_count=1``) hands the row groups over in that order: a pool of several workers hands
  them over in completion order, so the batch sequence would depend on thread timing;
* rows are mixed across row groups in a window of ``shuffle_buffer`` rows permuted by a
  ``torch.Generator`` seeded with the epoch seed (:func:`~pipeline.data.engines.window_batches`,
  as the streaming engine does; Petastorm's own ``shuffle_rows`` only permutes within a row group
  and is left off); every row group is read once (``num_epochs=1``), so every row comes once;
* Petastorm's thread pool draws a number from Python's global ``random`` when it is built: the
  global state is restored around it, so the model's random streams are untouched.

Petastorm's reader thread reads row groups; a read-ahead thread of the engine takes them from
Petastorm as they come and decodes them into a queue of ``queue_size`` (Petastorm ventilates the
next row groups only after its consumer took the ones before); the reader's prefetch thread
(:class:`~pipeline.data.prefetch.DevicePrefetcher`) batches and transforms. None of them runs on
the training thread. Petastorm's ventilator keeps ``workers_count + 2`` row groups in flight and
polls every 10 ms when they are out, which bounds one reader thread at about 300 row groups per
second: larger row groups read proportionally faster (docs/loader.md).
"""
from __future__ import annotations

import random
import re
import warnings
from typing import Iterator, Optional, Sequence

import numpy as np

from ..errors import BadInputError
from ..extras import require
from ..fs import location
from ..schemas import pad_length
from ..shards.tensors import tensor_spec
from .engines import window_batches
from .parquet import parquet_files, read_parquet_schema
from .prefetch import DevicePrefetcher

# Petastorm 0.12 calls pyarrow's deprecated legacy dataset API on every reader and row group: one
# warning per call in every worker's log, about Petastorm's own code
for _category in (FutureWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=_category, module=r"petastorm(\.|$)")


class PetastormShard:
    """One shard read through ``petastorm.make_batch_reader``; ``epoch`` as the native engines.

    ``pool`` and ``workers`` are Petastorm's ``reader_pool_type`` and ``workers_count``: the
    defaults (one reader thread) are the only setting with a seeded batch order; the benchmark
    varies them (``bench/loader.py --profile``)."""

    def __init__(self, path: str, columns: Sequence[str], shuffle_buffer: int, pool: str = "thread",
                 workers: int = 1, queue_size: int = 8):
        require("petastorm")
        from .petastorm_fs import petastorm_filesystem

        self.path, self.columns = path, list(columns)
        self.shuffle_buffer = int(shuffle_buffer)
        self.pool, self.workers, self.queue_size = pool, int(workers), int(queue_size)
        files = parquet_files(path)
        first = files[0]
        schema = read_parquet_schema(first)
        self.specs = {c: tensor_spec(schema.field(c)) for c in self.columns}
        self.types = {c: schema.field(c).type for c in self.columns}
        for c in self.columns:
            if self.specs[c] is None and pad_length(schema.field(c)) is not None:
                raise BadInputError(f"{first}: column {c!r} is a list of up to {pad_length(schema.field(c))} values "
                                    "(pad_to): the petastorm engine reads it only as a tensor column (the shard "
                                    "stage's default tensor_columns); use loader.engine=native for list columns")
        # the committed files by name, never the directory: nothing put beside them is read
        self.url = [petastorm_filesystem(location(f))[0] for f in files]
        self.filesystem = petastorm_filesystem(location(path))[1]

    def open_reader(self, seed: int, shuffle: bool):
        """Petastorm's reader over the shard's columns for one epoch (a context manager)."""
        from petastorm import make_batch_reader

        state = random.getstate()     # ThreadPool() draws from the global `random` when built
        try:
            return make_batch_reader(
                self.url, filesystem=self.filesystem, schema_fields=[f"^{re.escape(c)}$" for c in self.columns],
                reader_pool_type=self.pool, workers_count=self.workers, results_queue_size=self.queue_size,
                seed=(seed & 0xFFFFFFFF) if shuffle else None, shuffle_row_groups=shuffle, shuffle_rows=False,
                num_epochs=1)
        finally:
            random.setstate(state)

    def decoded(self, reader) -> Iterator[dict]:
        """``{column: torch tensor}`` of every row group the reader hands over."""
        import torch

        for b in reader:
            yield {c: torch.from_numpy(self._column(c, getattr(b, c))) for c in self.columns}

    def _column(self, name: str, values: np.ndarray) -> np.ndarray:
        spec = self.specs[name]
        n = len(values)
        if spec is not None:
            dtype, k = spec
            try:
                buf = bytearray().join(values)
            except TypeError:
                raise BadInputError(f"{self.path}: column {name!r} has null value(s)") from None
            if len(buf) != n * k * np.dtype(dtype).itemsize:
                raise BadInputError(f"{self.path}: column {name!r} does not hold {k} {dtype} values per row")
            return np.frombuffer(buf, dtype).reshape(n, k)
        import pyarrow as pa

        if values.dtype == object or (pa.types.is_integer(self.types[name]) and values.dtype.kind == "f"):
            raise BadInputError(f"{self.path}: column {name!r} has null value(s)")
        return np.array(values, copy=True)   # Arrow's buffers may be read-only; torch wants its own

    def epoch(self, seed: int, batch_size: int, shuffle: bool, skip: int = 0,
              limit: Optional[int] = None) -> Iterator[dict]:
        import torch

        g = torch.Generator().manual_seed(seed) if shuffle else None
        with self.open_reader(seed, shuffle) as reader:
            # Petastorm ventilates a row group only after its consumer took the previous ones, so a
            # thread of our own drains the reader (and decodes) into a queue of `queue_size` row
            # groups while the batches of the window before are handed out
            parts = iter(DevicePrefetcher(self.decoded(reader), "cpu", depth=self.queue_size))
            try:
                yield from window_batches(parts, g, batch_size, max(batch_size, self.shuffle_buffer), skip, limit)
            except RuntimeError as e:    # Petastorm's message for lists of several lengths
                if "are expected to be the same length" in str(e):
                    col = re.search(r"column '([^']+)'", str(e))
                    raise BadInputError(f"{self.path}: column {col.group(1) if col else '?'!r} has lists of "
                                        "several lengths; the reader needs one length per column") from None
                raise
            finally:
                parts.close()            # the read-ahead thread ends before the reader closes
