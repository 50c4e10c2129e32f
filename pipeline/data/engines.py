"""The native batching engines behind :class:`pipeline.data.shard_reader.ShardReader`.

Both engines decode Parquet with pyarrow into column tensors without per-row Python work
(:mod:`pipeline.data.parquet`) and yield dicts of column tensors. The batch sequence of an epoch
is a pure function of (data, seed): every random draw comes from one ``torch.Generator`` seeded
with the epoch seed (torch's global RNG is never touched), and the data arrive in a fixed order
whatever the number of decoding threads.

* :class:`MemoryShard`: the whole shard decoded once (cached per process, so the next epoch's
  reader reuses it) and reshuffled in memory every epoch: one ``randperm`` over all rows, batches
  gathered with ``index_select``.
* :class:`StreamShard`: row groups in a seeded order, read and decoded by a thread pool
  (``read_row_group``; pyarrow releases the GIL) with results consumed in submission order;
  rows are shuffled within a window of ``shuffle_buffer`` rows (plus the previous window's
  remainder, :func:`window_batches`), so memory stays bounded by a few row groups.

Every row of the shard is yielded exactly once per epoch in both engines. The Petastorm engine
(:mod:`pipeline.data.petastorm_engine`) batches its row groups with the same :func:`window_batches`.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Optional, Sequence

from ..errors import BadInputError
from ..fs import location
from .parquet import RowGroup, decode_table, file_stamp, open_parquet, parquet_files, row_groups

#: default in-memory budget: this fraction of the memory available when the reader opens
MEMORY_FRACTION = 0.25


def default_memory_budget(fraction: float = MEMORY_FRACTION) -> int:
    """Bytes a worker may spend on holding its decoded shard: ``fraction`` of available memory."""
    import psutil

    return int(fraction * psutil.virtual_memory().available)


def default_decode_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _concat(parts: list[dict]) -> dict:
    import torch

    if len(parts) == 1:
        return parts[0]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _rows(cols: dict) -> int:
    return int(next(iter(cols.values())).shape[0])


# --------------------------------------------------------------------------- in memory
class MemoryShard:
    """A decoded shard held in memory, reshuffled per epoch with an isolated generator."""

    _cache: dict = {}   # at most one entry per process: the last shard loaded (the worker's own)

    def __init__(self, cols: dict):
        self.cols = cols
        self.n = _rows(cols)

    @classmethod
    def clear_cache(cls) -> None:
        """Forget the cached shard (a benchmark timing the load again)."""
        cls._cache.clear()

    @classmethod
    def load(cls, path: str, columns: Sequence[str], progress: Optional[Callable[[], None]] = None) -> "MemoryShard":
        """Decode the whole directory once, row group by row group (Arrow decodes with its own
        threads; ``progress()`` is called after each one); later calls with the same directory,
        columns and unchanged files return the cached copy."""
        files = parquet_files(path)
        key = (str(location(path)), tuple(columns), tuple(file_stamp(f) for f in files))
        hit = cls._cache.get(key)
        if hit is not None:
            return hit
        parts = []
        for f in files:
            try:
                pf = open_parquet(f)
                for i in range(pf.num_row_groups):
                    t = pf.read_row_group(i, columns=list(columns))
                    if t.num_rows:
                        parts.append(decode_table(t, columns, f))
                    if progress is not None:
                        progress()
            except BadInputError:
                raise
            except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt files
                raise BadInputError(f"{f}: unreadable Parquet ({str(e).splitlines()[0]})") from None
        if not parts:
            raise BadInputError(f"{path}: the shard has no rows")
        shard = cls(_concat(parts))
        cls._cache.clear()
        cls._cache[key] = shard
        return shard

    def epoch(self, seed: int, batch_size: int, shuffle: bool, skip: int = 0,
              limit: Optional[int] = None) -> Iterator[dict]:
        """Batches ``skip .. limit-1`` of the epoch (skipped batches cost nothing)."""
        import torch

        nb = -(-self.n // batch_size)
        stop = nb if limit is None else min(nb, limit)
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(seed)) if shuffle else None
        for i in range(skip, stop):
            lo, hi = i * batch_size, min(self.n, (i + 1) * batch_size)
            if perm is None:
                yield {k: v[lo:hi] for k, v in self.cols.items()}
            else:
                idx = perm[lo:hi]
                yield {k: v.index_select(0, idx) for k, v in self.cols.items()}


# --------------------------------------------------------------------------- streaming
class StreamShard:
    """Row groups read in parallel, in a seeded order, shuffled within a bounded window."""

    def __init__(self, path: str, columns: Sequence[str], shuffle_buffer: int, threads: int,
                 progress: Optional[Callable[[], None]] = None):
        self.path, self.columns = path, list(columns)
        self.groups = row_groups(path)
        self.shuffle_buffer = int(shuffle_buffer)
        self.threads = max(1, int(threads))
        self.progress = progress  # called after each decoded row group (also while skipping batches)
        self._local = threading.local()

    def _read(self, g: RowGroup) -> dict:
        files = self._local.__dict__.setdefault("files", {})
        try:
            pf = files.get(g.file) or files.setdefault(g.file, open_parquet(g.file))
            t = pf.read_row_group(g.index, columns=self.columns, use_threads=False)
        except BadInputError:
            raise
        except Exception as e:  # noqa: BLE001 - corrupt file
            raise BadInputError(f"{g.file}: unreadable row group {g.index} ({str(e).splitlines()[0]})") from None
        return decode_table(t, self.columns, g.file)

    def _decoded(self, order: list[RowGroup]) -> Iterator[dict]:
        """Decoded row groups in ``order``, read ahead by the pool (results in submission order)."""
        ex = ThreadPoolExecutor(self.threads, thread_name_prefix="pipeline-decode")
        ahead = 2 * self.threads
        futures = []
        try:
            it = iter(order)
            for g in it:
                futures.append(ex.submit(self._read, g))
                if len(futures) >= ahead:
                    break
            while futures:
                done = futures.pop(0).result()
                nxt = next(it, None)
                if nxt is not None:
                    futures.append(ex.submit(self._read, nxt))
                if self.progress is not None:
                    self.progress()
                yield done
        finally:
            for f in futures:
                f.cancel()
            ex.shutdown(wait=True, cancel_futures=True)

    def epoch(self, seed: int, batch_size: int, shuffle: bool, skip: int = 0,
              limit: Optional[int] = None) -> Iterator[dict]:
        import torch

        g = torch.Generator().manual_seed(seed)
        order = ([self.groups[i] for i in torch.randperm(len(self.groups), generator=g).tolist()]
                 if shuffle else list(self.groups))
        return window_batches(self._decoded(order), g if shuffle else None, batch_size,
                              max(batch_size, self.shuffle_buffer), skip, limit)


def window_batches(parts: Iterable[dict], generator, batch_size: int, window: int, skip: int = 0,
                   limit: Optional[int] = None) -> Iterator[dict]:
    """Batches ``skip .. limit-1`` of a stream of decoded row groups (dicts of column tensors).

    Row groups are collected until ``window`` rows are pending; the pending rows are permuted with
    ``generator`` (None: kept in order) and cut into full batches, the remainder joins the next
    window; the last batch of the stream may be smaller. Every row comes out exactly once."""
    import torch

    pending: list[dict] = []
    n_pending, i = 0, 0

    def drain(final: bool):
        nonlocal pending, n_pending, i
        buf = _concat(pending)
        if generator is not None:
            p = torch.randperm(n_pending, generator=generator)
            buf = {k: v.index_select(0, p) for k, v in buf.items()}
        full = n_pending if final else (n_pending // batch_size) * batch_size
        for lo in range(0, full, batch_size):
            if limit is not None and i >= limit:
                return True
            if i >= skip:
                yield {k: v[lo:lo + batch_size] for k, v in buf.items()}
            i += 1
        rest = {k: v[full:] for k, v in buf.items()}
        pending, n_pending = ([rest] if full < _rows(buf) else []), _rows(buf) - full
        return False

    for cols in parts:
        if not _rows(cols):
            continue
        pending.append(cols)
        n_pending += _rows(cols)
        if n_pending >= window:
            if (yield from drain(final=False)):
                return
    if n_pending:
        yield from drain(final=True)
