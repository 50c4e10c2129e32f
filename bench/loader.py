"""Benchmark of the training input path (pipeline.data.shard_reader.ShardReader), both engines.

For the HLF (14 floats), image (28x28 uint8) and LLF (801x19 floats) shards it prints, in one run:

* bare read rows/s: one epoch through the native engine in ``memory`` mode (after the one-time
  load, whose time is printed too) and in ``stream`` mode, through the Petastorm engine
  (``loader.engine: petastorm``: ``make_batch_reader`` on one reader thread, the same batches'
  contracts) and, for reference, through Petastorm's own ``BatchedDataLoader`` over the same rows
  written as list columns (its loader cannot hand fixed-size binary columns to torch);
* training samples/s of the same loop fed by the native engine (auto mode), by the Petastorm engine
  and by in-memory tensors (batches gathered from resident tensors, no reader), for the HLF
  classifier at batch 128, LeNet-5 at batch 32 and the particle GRU at batch 32; and the Petastorm
  engine's bare read rate over the same batches the training took;
* with ``--profile``: where Petastorm's time goes (a cProfile of its reader with the single-threaded
  ``dummy`` pool, so every phase runs in the profiled thread) and what its settings change: pool type
  and workers, row-group size, batch size, and decoding in a ``TransformSpec`` instead of after the
  reader (bare read rows/s of the HLF and image shards, and whether the batch order is seeded);
* with ``--layouts``: decode rows/s and bytes on disk of the candidate feature layouts.

Targets: native engine: HLF bare read >= 1M rows/s; training fed by it >= 0.9x in-memory for HLF and
LeNet-5, >= 0.8x for LLF. Petastorm engine: LeNet-5 training fed by it >= 0.9x the in-memory rate;
HLF training fed by it >= 0.9x its own bare read rate of the same rows (training adds no stall of
its own). The training loop and torch run on one thread, Arrow on one, one native decoding thread
(``--threads``); the Petastorm engine adds its reader thread and the prefetch thread.

The shards are written like the shard stage writes them (pyarrow, snappy, row groups of 1024
rows): the rows are random values of the real shapes and types (the loader's work does not depend
on the values), ``--rows`` of them (default 100,000; LLF ``--llf-rows``, default 100,000, about
6 GB decoded). ``--small`` is a smoke run (2,000 / 300 rows, few steps).

    .venv/bin/python bench/loader.py [--small] [--only hlf,image,llf] [--profile] [--layouts] [--threads 1]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

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


def write_shard(out: Path, name: str, rows: int, seed: int = 0, tensors: bool = True,
                row_group: int = ROW_GROUP) -> Path:
    """A worker directory of ``rows`` rows of data set ``name`` in the shard stage's layout
    (``tensors=False``: feature columns as plain lists, the layout Petastorm can read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    writer = None
    for lo in range(0, rows, 8 * row_group):
        n = min(8 * row_group, rows - lo)
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
        writer.write_table(t, row_group_size=row_group)
    writer.close()
    return out


# ----------------------------------------------------------------------------- measurements
def bare_loader(path: Path, features: str, batch: int, mode: str, threads: int) -> tuple[float, float]:
    """(rows/s over one epoch of the native engine in ``mode``, seconds of the one-time load before it)."""
    from pipeline.data.engines import MemoryShard
    from pipeline.data.shard_reader import ShardReader

    MemoryShard.clear_cache()
    t0 = time.perf_counter()
    with ShardReader(str(path), batch, features, seed=1, mode=mode, decode_threads=threads) as r:
        load = time.perf_counter() - t0
        t1 = time.perf_counter()
        n = sum(int(y.shape[0]) for _, y in r)
    return n / (time.perf_counter() - t1), load


def petastorm_engine(path: Path, features: str, batch: int, steps: Optional[int] = None, **engine) -> float:
    """rows/s of the Petastorm engine (the reader training gets with ``loader.engine: petastorm``):
    one epoch, or ``steps`` batches after 3 warm-up batches (the batches a training run takes).
    ``engine`` overrides PetastormShard's settings (pool, workers)."""
    import petastorm  # noqa: F401 - the first import (about a second) stays outside the timing

    from pipeline.data.shard_reader import ShardReader

    with ShardReader(str(path), batch, features, seed=2, engine="petastorm", engine_options=engine) as r:
        it = r.batches(limit_batches=None if steps is None else steps + 3)
        t0, n = time.perf_counter(), 0
        for i, (_, y) in enumerate(it):
            if steps is not None and i == 3:
                t0, n = time.perf_counter(), 0
            if steps is None or i >= 3:
                n += int(y.shape[0])
    return n / (time.perf_counter() - t0)


def petastorm_loader(path: Path, features: str, batch: int, max_rows: int) -> float:
    """rows/s of Petastorm's own reader + BatchedDataLoader over list columns (reference)."""
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


def train_from_loader(path: Path, features: str, model_name: str, batch: int, steps: int, threads: int,
                      engine: str = "native") -> float:
    from pipeline.data.shard_reader import ShardReader

    model, opt = _model(model_name)
    with ShardReader(str(path), batch, features, seed=2, decode_threads=threads, engine=engine) as r:
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


# ----------------------------------------------------------------------------- Petastorm profile
PROFILE_POOLS = [("dummy", 1), ("thread", 1), ("thread", 2), ("thread", 4), ("process", 1), ("process", 2)]


def profile(root: Path, rows: int, batch_sizes=(32, 128, 1024), row_groups=(256, 1024, 4096)) -> None:
    """Where Petastorm's time goes (cProfile, dummy pool: every phase on this thread) and the bare
    read rows/s of the Petastorm engine under other settings, for the HLF and image shards."""
    import os

    os.environ["PYTHONWARNINGS"] = "ignore"       # the process pool's workers: pyarrow's legacy-API warnings
    print("\nPetastorm engine profile (bare read rows/s; 'seeded' = the batch order is a function of the seed):")
    for name in ("hlf", "image"):
        features, _, batch, _ = SETS[name]
        path = write_shard(root / f"profile-{name}", name, rows)
        _where_the_time_goes(path, features, batch)
        default = petastorm_engine(path, features, batch)
        print(f"  {name}: the engine as configured (thread pool, 1 worker, row groups of {ROW_GROUP}, "
              f"batch {batch}): {default:,.0f} rows/s")
        for pool, workers in PROFILE_POOLS:
            rate = petastorm_engine(path, features, batch, pool=pool, workers=workers)
            seeded = "seeded" if workers == 1 else "completion order: NOT seeded"
            print(f"    pool {pool:7s} workers {workers}: {rate:12,.0f} rows/s  ({seeded})")
        for size in row_groups:
            p = path if size == ROW_GROUP else write_shard(root / f"profile-{name}-rg{size}", name, rows, row_group=size)
            print(f"    row groups of {size:5d} rows: {petastorm_engine(p, features, batch):12,.0f} rows/s")
            if p != path:
                shutil.rmtree(p)
        for b in batch_sizes:
            print(f"    batch {b:5d}: {petastorm_engine(path, features, b):12,.0f} rows/s")
        print(f"    decoding in a TransformSpec (pandas round trip): {_transform_spec_rate(path, features):12,.0f} rows/s"
              f" (the engine decodes after the reader: {default:,.0f} rows/s)")
        shutil.rmtree(path)


def _where_the_time_goes(path: Path, features: str, batch: int, top: int = 12) -> None:
    """The Petastorm engine's epoch with the dummy pool under cProfile: own time of the top functions."""
    import cProfile
    import io
    import pstats

    from pipeline.data.petastorm_engine import PetastormShard
    from pipeline.data.shard_reader import FEATURE_COLUMNS, make_transform

    import petastorm  # noqa: F401 - its first import stays out of the profile

    shard = PetastormShard(str(path), FEATURE_COLUMNS[features], 2048, pool="dummy")
    transform = make_transform(features)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    n = sum(int(transform(cols)[1].shape[0]) for cols in shard.epoch(2, batch, True))
    prof.disable()
    wall = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    print(f"  {features}: dummy pool, one thread, {n:,} rows in {wall:.2f} s ({n / wall:,.0f} rows/s); "
          f"the {top} functions with the most own time:")
    for ln in lines[start:start + top + 1]:
        print("    " + ln.strip()[:150])


def _transform_spec_rate(path: Path, features: str) -> float:
    """rows/s of Petastorm's reader (thread pool, 1 worker) when a TransformSpec decodes the tensor
    column in the worker (per-row arrays back to Arrow, then stacked by Petastorm's results reader)."""
    import re
    import warnings

    from petastorm import make_batch_reader
    from petastorm.transform import TransformSpec

    from pipeline.data.parquet import read_parquet_schema
    from pipeline.data.shard_reader import FEATURE_COLUMNS
    from pipeline.shards.tensors import tensor_spec

    warnings.filterwarnings("ignore")
    col = {"hlf": "hlf", "image": "image"}[features]
    dtype, k = tensor_spec(read_parquet_schema(str(next(path.glob("*.parquet")))).field(col))

    def decode(df):
        df[col] = list(np.frombuffer(b"".join(df[col].values), dtype).reshape(-1, k))
        return df

    spec = TransformSpec(decode, edit_fields=[(col, np.dtype(dtype).type, (k,), False)])
    t0, n = time.perf_counter(), 0
    with make_batch_reader("file://" + str(path), schema_fields=[f"^{re.escape(c)}$" for c in FEATURE_COLUMNS[features]],
                           reader_pool_type="thread", workers_count=1, num_epochs=1, seed=2,
                           transform_spec=spec) as reader:
        for b in reader:
            n += len(getattr(b, col))
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
def _verdict(ratio: float, target: float) -> str:
    return f"ratio {ratio:.2f} ({'meets' if ratio >= target else 'BELOW'} the {target}x target)"


def measure(root: Path, name: str, rows: int, steps: int, threads: int, repeats: int,
            row_group: int = ROW_GROUP) -> None:
    """Bare read rates and the three training feeds of one data set (see the module docstring)."""
    from pipeline.data.engines import MemoryShard

    features, model, batch, target = SETS[name]
    t0 = time.perf_counter()
    path = write_shard(root / name, name, rows, row_group=row_group)
    print(f"\n== {name}: {rows:,} rows in row groups of {row_group:,} written in {time.perf_counter() - t0:.1f} s "
          f"({sum(f.stat().st_size for f in path.iterdir()) / 1e6:.0f} MB)")
    mem, load = bare_loader(path, features, batch, "memory", threads)
    stream, _ = bare_loader(path, features, batch, "stream", threads)
    peta_epoch = petastorm_engine(path, features, batch)
    n_ref = min(rows, 20_000 if name != "llf" else 1000)
    lists = write_shard(root / f"{name}-lists", name, n_ref, tensors=False)
    reference = petastorm_loader(lists, features, batch, max_rows=n_ref)
    shutil.rmtree(lists)
    print(f"  bare read, batch {batch}: native memory {mem:,.0f} rows/s (one-time load {load:.2f} s), "
          f"native stream {stream:,.0f} rows/s, Petastorm engine {peta_epoch:,.0f} rows/s; "
          f"Petastorm's BatchedDataLoader over list columns {reference:,.0f} rows/s")
    steps = min(max(5, steps // 5) if name == "llf" else steps, rows // batch - 4)
    native = peta = ref = peta_bare = 0.0
    for _ in range(repeats):          # alternating, best of each: load from other processes hurts all
        native = max(native, train_from_loader(path, features, model, batch, steps, threads))
        peta = max(peta, train_from_loader(path, features, model, batch, steps, threads, engine="petastorm"))
        ref = max(ref, train_from_memory(path, features, model, batch, steps))
        peta_bare = max(peta_bare, petastorm_engine(path, features, batch, steps=steps))
    print(f"  training {model} batch {batch}, {steps} steps (samples/s): fed by the native engine {native:,.0f}, "
          f"by the Petastorm engine {peta:,.0f}, by in-memory tensors {ref:,.0f}; "
          f"Petastorm engine bare over the same batches {peta_bare:,.0f} rows/s")
    print(f"    native / in-memory: {_verdict(native / ref, target)}")
    print(f"    Petastorm / in-memory: {_verdict(peta / ref, 0.9) if name == 'image' else f'ratio {peta / ref:.2f}'}")
    print(f"    Petastorm-fed / Petastorm bare: {_verdict(peta / peta_bare, 0.9) if name == 'hlf' else f'ratio {peta / peta_bare:.2f}'}")
    if name == "hlf":
        v = "meets" if mem >= 1e6 else "BELOW"
        print(f"  HLF bare read (native memory mode) {mem / 1e6:.2f}M rows/s: {v} the 1M rows/s target")
    MemoryShard.clear_cache()
    shutil.rmtree(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000, help="rows of the HLF and image shards")
    p.add_argument("--llf-rows", type=int, default=100_000, help="rows of the LLF shard")
    p.add_argument("--steps", type=int, default=300, help="training steps per measurement (LLF: a fifth)")
    p.add_argument("--only", default="hlf,image,llf")
    p.add_argument("--profile", action="store_true", help="also profile the Petastorm engine and vary its settings")
    p.add_argument("--layouts", action="store_true", help="also compare the candidate feature layouts")
    p.add_argument("--threads", type=int, default=1, help="torch, Arrow and decoding threads")
    p.add_argument("--repeats", type=int, default=3, help="training measurements alternate this often (best kept)")
    p.add_argument("--row-group", type=int, default=ROW_GROUP, help="rows per row group of the shards (the shard "
                                                                  "stage's row_group_rows)")
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
            measure(root, name, a.llf_rows if name == "llf" else a.rows, a.steps, a.threads, a.repeats, a.row_group)
        if a.profile:
            profile(root, a.rows)
        if a.layouts:
            layouts(root, a.rows)
    finally:
        if a.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
