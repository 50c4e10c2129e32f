"""The batching engines behind :class:`pipeline.data.reader.ShardReader`.

Both engines decode Parquet with pyarrow into column tensors without per-row Python work (a
tensor column of the shards, :mod:`pipeline.shards.tensors`, is one buffer copy; a list column of
fixed length becomes one ``(rows, length)`` array from its values buffer) and yield
dicts of column tensors. The batch sequence of an epoch is a pure function of (data, seed): every
random draw comes from one ``torch.Generator`` seeded with the epoch seed (torch's global RNG is
never touched), and the data arrive in a fixed order whatever the number of decoding threads.

* :class:`MemoryShard`: the whole shard decoded once (cached per process, so the next epoch's
  reader reuses it) and reshuffled in memory every epoch: one ``randperm`` over all rows, batches
  gathered with ``index_select``.
* :class:`StreamShard`: row groups in a seeded order, read and decoded by a thread pool
  (``read_row_group``; pyarrow releases the GIL) with results consumed in submission order;
  rows are shuffled within a window of ``shuffle_buffer`` rows (plus the previous window's
  remainder), so memory stays bounded by a few row groups.
* :class:`DevicePrefetcher`: on an accelerator, batches are produced and copied on a background
  thread (pinned host memory, ``non_blocking`` copies on a side CUDA stream) while the model
  computes on the current batch.

Every row of the shard is yielded exactly once per epoch in both engines.

A shard is a local directory or an object-store prefix (``s3://bucket/key``): a remote shard's
Parquet files are listed and read in place through :mod:`pyarrow.fs` (:mod:`pipeline.fs` gives
the filesystem; row groups are fetched by range requests), a local one is opened by path as
before, so the two give the same batches and the local path pays nothing extra.
"""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from ..errors import BadInputError
from ..fs import is_dir, list_files, location
from ..schemas import pad_length
from ..shards.tensors import decode, rows_array, tensor_spec

#: default in-memory budget: this fraction of the memory available when the reader opens
MEMORY_FRACTION = 0.25


def default_memory_budget(fraction: float = MEMORY_FRACTION) -> int:
    """Bytes a worker may spend on holding its decoded shard: ``fraction`` of available memory."""
    import psutil

    return int(fraction * psutil.virtual_memory().available)


def default_decode_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# --------------------------------------------------------------------------- files and decoding
@dataclass(frozen=True)
class RowGroup:
    file: str
    index: int
    rows: int


def parquet_files(path: str) -> list[str]:
    """The shard's Parquet files, sorted (names starting with ``.`` or ``_`` skipped): local paths,
    or ``s3://`` URIs for a shard on an object store. ``path`` may also name one file."""
    loc = location(path)
    if loc.is_local:
        p = Path(loc.path)
        files = ([str(x) for x in sorted(p.rglob("*.parquet")) if not x.name.startswith((".", "_"))]
                 if p.is_dir() else [str(p)])
    elif is_dir(loc):
        files = [str(f) for f in list_files(loc, ".parquet") if not f.name.startswith((".", "_"))]
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
                tables = (pf.read_row_group(i, columns=list(columns)) for i in range(pf.num_row_groups))
                for t in tables:
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
        window = max(batch_size, self.shuffle_buffer)
        pending: list[dict] = []
        n_pending, i = 0, 0

        def drain(final: bool):
            nonlocal pending, n_pending, i
            buf = _concat(pending)
            if shuffle:
                p = torch.randperm(n_pending, generator=g)
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

        for cols in self._decoded(order):
            if self.progress is not None:
                self.progress()
            pending.append(cols)
            n_pending += _rows(cols)
            if n_pending >= window:
                if (yield from drain(final=False)):
                    return
        if n_pending:
            yield from drain(final=True)


# --------------------------------------------------------------------------- device prefetch
_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _map_tensors(item: Any, fn) -> Any:
    if isinstance(item, tuple):
        return tuple(_map_tensors(x, fn) for x in item)
    if isinstance(item, list):
        return [_map_tensors(x, fn) for x in item]
    return fn(item) if hasattr(item, "to") else item


class DevicePrefetcher:
    """Iterate ``batches`` on a background thread, each tensor copied to ``device`` ahead of use.

    ``pin`` (default: the device is CUDA) stages every tensor in pinned host memory so the copy
    runs asynchronously (``non_blocking=True``) on a side CUDA stream; the consumer's stream
    waits for that copy before the batch is handed out. At most ``depth`` batches are in flight.
    Exceptions of the producer are re-raised in the consumer; closing the iterator early stops
    the thread.
    """

    def __init__(self, batches: Iterable, device: Any, depth: int = 2, pin: Optional[bool] = None):
        import torch

        self.batches = batches
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda if pin is None else bool(pin)
        self.depth = max(1, int(depth))

    def _copy(self, t):
        if self.pin and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _produce(self, q: "queue.Queue", stop: threading.Event) -> None:
        import torch

        stream = torch.cuda.Stream(self.device) if self.cuda else None
        try:
            for item in self.batches:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        moved = _map_tensors(item, self._copy)
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    moved, event = _map_tensors(item, self._copy), None
                while not stop.is_set():
                    try:
                        q.put((moved, event), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(_Failed(e))

    def __iter__(self) -> Iterator:
        import torch

        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        t = threading.Thread(target=self._produce, args=(q, stop), name="pipeline-prefetch", daemon=True)
        t.start()
        try:
            while True:
                got = q.get()
                if got is _END:
                    return
                if isinstance(got, _Failed):
                    raise got.exc
                moved, event = got
                if event is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    _map_tensors(moved, lambda x: x.record_stream(current))
                yield moved
        finally:
            stop.set()
            while t.is_alive():
                try:
                    q.get(timeout=0.1)
                except queue.Empty:
                    pass
            t.join()
