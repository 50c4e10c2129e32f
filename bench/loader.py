"""Benchmark of the training input path (pipeline.data.shard_reader.ShardReader).

For the HLF (14 floats), image (28x28 uint8) and LLF (801x19 floats) shards it prints, in one run:

* bare loader rows/s: one epoch through ``ShardReader`` in ``memory`` mode (after the one-time
  load, whose time is printed too) and in ``stream`` mode, and, for reference, through Petastorm's
  ``make_batch_reader`` + ``BatchedDataLoader`` (the reader used before) over the same rows
  written as list columns (Petastorm cannot hand fixed-size binary columns to torch),
* training samples/s fed by the loader (``ShardReader``, auto mode) and fed by in-memory tensors
  (batches gathered from resident tensors, no reader), and their ratio, for the HLF classifier at
  batch 128, LeNet-5 at batch 32 and the particle GRU at batch 32,
* with ``--layouts``: decode rows/s and bytes on disk of the candidate feature layouts (one list
  column, fixed-width columns, one binary tensor per row).

Targets: HLF bare loader >= 1M rows/s on one core; training fed by the loader >= 0.9x in-memory
for HLF and LeNet-5, >= 0.8x for LLF. Everything runs on one core (torch and Arrow threads set to
1, one decoding thread) unless ``--threads`` says otherwise.

The shards are written like the shard stage writes them (pyarrow, snappy, row groups of 1024
rows): the rows are random values of the real shapes and types (the loader's work does not depend
on the values), ``--rows`` of them (default 100,000; LLF ``--llf-rows``, default 100,000, about
6 GB decoded). ``--small`` is a smoke run (2,000 / 300 rows, few steps).

    .venv/bin/python bench/loader.py [--small] [--only hlf,image,llf] [--layouts] [--threads 1]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

ROW_GROUP = 1024
SETS = {  # name: (features, model, batch, target ratio)
    "hlf": ("hlf", "hlf", 128, 0.9),
    "image": ("image", "lenet5", 32, 0.9),
    "llf": ("llf", "gru", 32, 0.8),
}


# ----------------------------------------------------------------------------- data
def _list(values: np.ndarray, k: int):
    import pyarrow as pa

    n = values.size // k
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), pa.array(values.reshape(-1)))


def writer_options(schema, tensors):
    from pipeline.shards.materialize import writer_options as opts
    from pipeline.shards.tensors import TENSOR_COLUMNS

    return opts(schema, [c for c in TENSOR_COLUMNS if c in schema.names and c in tensors])


def _as_tensor_layout(t):
    """The tensor columns encoded as the shard stage writes them (pipeline.shards.tensors)."""
    import pyarrow as pa

    from pipeline.shards.tensors import TENSOR_COLUMNS, encode, tensor_field

    fields, cols = [], []
    for f in t.schema:
        if f.name in TENSOR_COLUMNS:
            dtype = f.type.value_type.to_pandas_dtype().__name__
            k = len(t.column(f.name)[0])
            fields.append(tensor_field(f.name, dtype, k))
            cols.append(encode(t.column(f.name), f.name, dtype, k))
        else:
            fields.append(f)
            cols.append(t.column(f.name))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def write_shard(out: Path, name: str, rows: int, seed: int = 0, tensors: bool = True) -> Path:
    """A worker directory of ``rows`` rows of data set ``name`` in the shard stage's layout
    (``tensors=False``: feature columns as plain lists, the layout Petastorm can read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    writer = None
    for lo in range(0, rows, 8 * ROW_GROUP):
        n = min(8 * ROW_GROUP, rows - lo)
        cols = {"sample_id": pa.array(np.arange(lo, lo + n, dtype=np.int64)),
                "label": pa.array(rng.integers(0, 10 if name == "image" else 3, n).astype(np.int64))}
        if name == "hlf":
            cols["hlf"] = _list(rng.normal(size=(n, 14)).astype(np.float32), 14)
        elif name == "image":
            cols["image"] = _list(rng.integers(0, 256, (n, 784), dtype=np.uint8), 784)
            for c, v in (("height", 28), ("width", 28), ("channels", 1)):
                cols[c] = pa.array(np.full(n, v, np.int32))
        else:
            npart = rng.integers(5, 200, n).astype(np.int32)
            llf = np.zeros((n, 801, 19), np.float32)
            for i in range(n):
                llf[i, :npart[i]] = rng.normal(size=(npart[i], 19))
            cols["llf"] = _list(llf.reshape(n, -1), 801 * 19)
            cols["n_particles"] = pa.array(npart)
            cols["hlf"] = _list(rng.normal(size=(n, 14)).astype(np.float32), 14)
        t = _as_tensor_layout(pa.table(cols)) if tensors else pa.table(cols)
        if writer is None:
            writer = pq.ParquetWriter(out / "part-00000.parquet", t.schema,
                                      **writer_options(t.schema, t.schema.names if tensors else ()))
        writer.write_table(t, row_group_size=ROW_GROUP)
    writer.close()
    return out


# ----------------------------------------------------------------------------- measurements
def bare_loader(path: Path, features: str, batch: int, mode: str, threads: int) -> tuple[float, float]:
    """(rows/s over one epoch, seconds of the one-time load before the epoch)."""
    from pipeline.data.engines import MemoryShard
    from pipeline.data.shard_reader import ShardReader

    MemoryShard._cache.clear()
    t0 = time.perf_counter()
    with ShardReader(str(path), batch, features, seed=1, mode=mode, decode_threads=threads) as r:
        load = time.perf_counter() - t0
        t1 = time.perf_counter()
        n = sum(int(y.shape[0]) for _, y in r)
    return n / (time.perf_counter() - t1), load


def petastorm_loader(path: Path, features: str, batch: int, max_rows: int) -> float:
    """rows/s of the Petastorm reader + BatchedDataLoader the training used before (reference)."""
    import warnings

    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    from pipeline.data.shard_reader import FEATURE_COLUMNS
    from pipeline.outputs import uri

    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    n = 0
    with make_batch_reader(uri(path), schema_fields=FEATURE_COLUMNS[features], reader_pool_type="dummy",
                           num_epochs=1, seed=1, shuffle_row_groups=True) as reader:
        for b in BatchedDataLoader(reader, batch_size=batch, shuffling_queue_capacity=2048):
            n += int(b["label"].shape[0])
            if n >= max_rows:
                break
    return n / (time.perf_counter() - t0)


def _model(name: str):
    import torch

    from pipeline.train.models import build_model

    torch.manual_seed(0)
    m = build_model(name, 10 if name == "lenet5" else 3, {"height": 28, "width": 28, "channels": 1})
    return m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)


def _step(model, opt, inputs, y) -> None:
    import torch.nn.functional as F

    opt.zero_grad()
    F.cross_entropy(model(*inputs), y).backward()
    opt.step()


def train_from_loader(path: Path, features: str, model_name: str, batch: int, steps: int, threads: int) -> float:
    from pipeline.data.shard_reader import ShardReader

    model, opt = _model(model_name)
    with ShardReader(str(path), batch, features, seed=2, decode_threads=threads) as r:
        it = r.batches(limit_batches=steps + 3)
        for _ in range(3):                    # warm-up (and the one-time load) outside the timing
            _step(model, opt, *next(it))
        t0, n = time.perf_counter(), 0
        for inputs, y in it:
            _step(model, opt, inputs, y)
            n += int(y.shape[0])
    return n / (time.perf_counter() - t0)


def train_from_memory(path: Path, features: str, model_name: str, batch: int, steps: int) -> float:
    """The same loop fed by batches gathered from resident, already transformed tensors."""
    import torch

    from pipeline.data.shard_reader import ShardReader

    with ShardReader(str(path), min(4096, batch * (steps + 3)), features, shuffle=False, mode="stream") as r:
        inputs, y = next(iter(r))               # up to 4,096 decoded rows, cycled
    model, opt = _model(model_name)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(y.shape[0], generator=g)

    def batch_at(i):
        lo = (i * batch) % max(1, y.shape[0] - batch + 1)
        idx = perm[lo:lo + batch] if y.shape[0] >= batch else perm
        return tuple(x.index_select(0, idx) for x in inputs), y.index_select(0, idx)

    for i in range(3):
        _step(model, opt, *batch_at(i))
    t0, n = time.perf_counter(), 0
    for i in range(3, steps + 3):
        xs, ys = batch_at(i)
        _step(model, opt, xs, ys)
        n += int(ys.shape[0])
    return n / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------- layouts
def layouts(root: Path, rows: int) -> None:
    """Decode rows/s and bytes on disk of three layouts of the HLF and image features."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.parquet import decode_column
    from pipeline.shards.tensors import decode, encode

    rng = np.random.default_rng(0)
    print("\nlayout comparison (decode of every row group to one (rows, k) array, one thread):")
    print(f"  {'features':10s} {'layout':22s} {'MB on disk':>10s} {'rows/s':>12s}")
    for name, k, x in (("hlf", 14, rng.normal(size=(rows, 14)).astype(np.float32)),
                       ("image", 784, rng.integers(0, 256, (rows, 784), dtype=np.uint8))):
        cands = {
            "list column": (pa.table({"x": _list(x, k)}),
                            lambda t: decode_column(t.column("x"), "x", "bench")),
            "fixed-width columns": (pa.table({f"x{j}": x[:, j] for j in range(k)}),
                                    lambda t: np.stack([c.to_numpy() for c in t.columns], axis=1)),
            "binary tensor per row": (pa.table({"x": pa.array([r.tobytes() for r in x], pa.binary())}),
                                      lambda t, dt=x.dtype: _binary(t.column("x"), dt, k)),
            "fixed-size binary": (pa.table({"x": encode(_list(x, k), "x", x.dtype.name, k)}),
                                  lambda t, dt=x.dtype.name: decode(t.column("x"), dt, k)),
        }
        for label, (table, fn) in cands.items():
            d = root / f"layout-{name}-{label.split()[0]}.parquet"
            pq.write_table(table, d, row_group_size=ROW_GROUP, compression="snappy")
            pf = pq.ParquetFile(d)
            t0 = time.perf_counter()
            n = 0
            for i in range(pf.num_row_groups):
                arr = fn(pf.read_row_group(i, use_threads=False))
                n += arr.shape[0]
            rate = n / (time.perf_counter() - t0)
            print(f"  {name:10s} {label:22s} {d.stat().st_size / 1e6:10.1f} {rate:12,.0f}")


def _binary(col, dtype, k: int) -> np.ndarray:
    arr = col.combine_chunks()
    offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]
    return data.view(dtype).reshape(len(arr), k)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000, help="rows of the HLF and image shards")
    p.add_argument("--llf-rows", type=int, default=100_000, help="rows of the LLF shard")
    p.add_argument("--steps", type=int, default=300, help="training steps per measurement (LLF: a fifth)")
    p.add_argument("--only", default="hlf,image,llf")
    p.add_argument("--layouts", action="store_true", help="also compare the candidate feature layouts")
    p.add_argument("--threads", type=int, default=1, help="torch, Arrow and decoding threads")
    p.add_argument("--repeats", type=int, default=3, help="training measurements alternate this often (best kept)")
    p.add_argument("--small", action="store_true", help="smoke run: 2,000 rows (LLF 300), 30 steps")
    p.add_argument("--workdir", default=None, help="where the shards are written (default: a temp dir)")
    a = p.parse_args(argv)
    if a.small:
        a.rows, a.llf_rows, a.steps = 2000, 300, 30

    import pyarrow as pa
    import torch

    torch.set_num_threads(a.threads)
    pa.set_cpu_count(a.threads)
    root = Path(a.workdir or tempfile.mkdtemp(prefix="bench-loader-"))
    print(f"bench/loader: {a.rows:,} rows (LLF {a.llf_rows:,}), {a.threads} thread(s), data in {root}")
    try:
        for name in [s for s in a.only.split(",") if s]:
            features, model, batch, target = SETS[name]
            rows = a.llf_rows if name == "llf" else a.rows
            t0 = time.perf_counter()
            path = write_shard(root / name, name, rows)
            print(f"\n== {name}: {rows:,} rows written in {time.perf_counter() - t0:.1f} s "
                  f"({sum(f.stat().st_size for f in path.iterdir()) / 1e6:.0f} MB)")
            mem, load = bare_loader(path, features, batch, "memory", a.threads)
            stream, _ = bare_loader(path, features, batch, "stream", a.threads)
            n_peta = min(rows, 20_000 if name != "llf" else 1000)
            lists = write_shard(root / f"{name}-lists", name, n_peta, tensors=False)
            peta = petastorm_loader(lists, features, batch, max_rows=n_peta)
            shutil.rmtree(lists)
            print(f"  bare loader, batch {batch}: memory {mem:,.0f} rows/s (one-time load {load:.2f} s), "
                  f"stream {stream:,.0f} rows/s, Petastorm BatchedDataLoader {peta:,.0f} rows/s")
            steps = max(5, a.steps // 5) if name == "llf" else a.steps
            steps = min(steps, rows // batch - 4)
            fed = ref = 0.0
            for _ in range(a.repeats):        # alternating, best of each: load from other processes hurts both
                fed = max(fed, train_from_loader(path, features, model, batch, steps, a.threads))
                ref = max(ref, train_from_memory(path, features, model, batch, steps))
            verdict = "meets" if fed / ref >= target else "BELOW"
            print(f"  training {model} batch {batch}, {steps} steps: fed by the loader {fed:,.0f} samples/s, "
                  f"by in-memory tensors {ref:,.0f} samples/s: ratio {fed / ref:.2f} ({verdict} the {target}x target)")
            if name == "hlf":
                v = "meets" if mem >= 1e6 else "BELOW"
                print(f"  HLF bare loader (memory mode) {mem / 1e6:.2f}M rows/s: {v} the 1M rows/s target")
            from pipeline.data.engines import MemoryShard
            MemoryShard._cache.clear()
            shutil.rmtree(path)
        if a.layouts:
            layouts(root, a.rows)
    finally:
        if a.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
