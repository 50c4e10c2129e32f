"""A worker's shard directory -> torch batches, seeded per (worker, epoch).

Used with ``with``::

    with ShardReader(path, batch_size=32, features="image", seed=epoch_seed(s, w, e)) as batches:
        for inputs, labels in batches: ...

Two engines (``engine``): ``native`` (:mod:`pipeline.data.engines`, the default): a shard that
fits the memory budget is decoded once per process and reshuffled in memory every epoch; a larger
one streams row groups decoded by a thread pool through a bounded shuffle window. ``petastorm``
(:mod:`pipeline.data.petastorm_engine`): Petastorm's ``make_batch_reader`` reads the row groups on
one reader thread, batched through the same shuffle window on a prefetch thread. Either way the
batch sequence is a pure function of (data, seed) drawn from an isolated ``torch.Generator`` (the
model's RNG stream is untouched), every row comes exactly once per epoch, and a resumed run replays
an epoch up to its checkpoint by skipping batches. docs/loader.md has the measured throughput.

Features (``image`` | ``hlf`` | ``llf`` | ``inclusive``):

* image: ``image`` list<uint8> (flattened HWC) -> float32 /255, reshaped to NCHW.
* hlf: ``hlf`` (14) -> (x - mean) / std with ``scaling.json``.
* llf: ``llf`` (801*19, particle-major) -> (n, 801, 19) scaled per feature, padding kept 0 using
  ``n_particles``; inputs ``(x, n_particles)``.
* inclusive: inputs ``(llf, n_particles, hlf)``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from ..errors import BadInputError
from ..features.layout import N_HLF, N_LLF_FEATURES, N_PARTICLES
from ..features.scaling import ScalingModel
from ..fs import is_file, location
from .prefetch import DevicePrefetcher

#: the loader's engines (``loader.engine``)
ENGINES = ("native", "petastorm")
FEATURE_COLUMNS = {
    "image": ["image", "height", "width", "channels", "label"],
    "hlf": ["hlf", "label"],
    "llf": ["llf", "n_particles", "label"],
    "inclusive": ["llf", "n_particles", "hlf", "label"],
}


def epoch_seed(base_seed: int, worker_seed: int, epoch: int) -> int:
    """The shuffling seed of one (worker, epoch): independent streams for every pair."""
    return int(np.random.SeedSequence([base_seed & 0xFFFFFFFF, worker_seed & 0xFFFFFFFF, epoch]).generate_state(1)[0])


# --------------------------------------------------------------------------- transforms
def load_scaling(path: Optional[str]) -> Optional[dict]:
    """The ``scaling.json`` at ``path`` (the :class:`pipeline.features.scaling.ScalingFile`
    contract) as ``{"hlf": {"mean", "std"}, "llf": {"mean", "std"}}``; BadInputError naming the
    file when it is missing or not valid. A local path or an ``s3://`` URI."""
    if path is None:
        return None
    loc = location(path)
    if not is_file(loc):
        raise BadInputError(f"scaling file not found: {loc}")
    m = ScalingModel.load(str(loc))
    return {"hlf": {"mean": m.hlf_mean.tolist(), "std": m.hlf_std.tolist()},
            "llf": {"mean": m.llf_mean.tolist(), "std": m.llf_std.tolist()}}


def make_transform(features: str, scaling: Optional[dict] = None) -> Callable[[dict], tuple]:
    """Columns (dict of torch tensors) -> ((inputs...), labels)."""
    import torch

    def scaler(key: str, n: int):
        if not scaling or key not in scaling:
            return None
        mean = torch.tensor(scaling[key]["mean"], dtype=torch.float32)
        std = torch.tensor(scaling[key]["std"], dtype=torch.float32)
        if mean.numel() != n or std.numel() != n:
            raise BadInputError(f"scaling.json: {key} needs {n} means/stds, has {mean.numel()}/{std.numel()}")
        return mean, torch.where(std > 0, std, torch.ones_like(std))

    hs = scaler("hlf", N_HLF) if features in ("hlf", "inclusive") else None
    ls = scaler("llf", N_LLF_FEATURES) if features in ("llf", "inclusive") else None

    def hlf(b):
        x = b["hlf"].float()
        return (x - hs[0]) / hs[1] if hs else x

    def llf(b):
        x = b["llf"].float().reshape(-1, N_PARTICLES, N_LLF_FEATURES)
        n = b["n_particles"].long().clamp(0, N_PARTICLES)
        if ls:
            x = (x - ls[0]) / ls[1]
            real = torch.arange(N_PARTICLES).unsqueeze(0) < n.unsqueeze(1)
            x = x * real.unsqueeze(-1)
        return x, n

    def image(b):
        h, w, c = int(b["height"][0]), int(b["width"][0]), int(b["channels"][0])
        # out of place: a float32 column's .float() is the engine's own buffer (the cached shard)
        x = b["image"].reshape(-1, h, w, c).permute(0, 3, 1, 2).float() / 255.0
        return x.contiguous()

    def transform(b: dict) -> tuple:
        y = b["label"].long()
        if features == "image":
            return (image(b),), y
        if features == "hlf":
            return (hlf(b),), y
        if features == "llf":
            return llf(b), y
        if features == "inclusive":
            x, n = llf(b)
            return (x, n, hlf(b)), y
        raise ValueError(f"unknown features {features!r}")

    return transform


def check_columns(path: str, features: str, extra: Sequence[str] = ()) -> None:
    """BadInputError naming the file and column when a part of a shard is unreadable, lacks a
    column the model needs (or one of ``extra``) or has a non-integer label."""
    import pyarrow as pa

    from .parquet import parquet_files, read_parquet_schema

    for f in parquet_files(path):
        try:
            schema = read_parquet_schema(f)
        except BadInputError:
            raise
        except Exception as e:  # noqa: BLE001 - corrupt file
            raise BadInputError(f"{f}: unreadable Parquet ({type(e).__name__})") from None
        names = set(schema.names)
        for col in list(FEATURE_COLUMNS[features]) + [c for c in extra if c not in FEATURE_COLUMNS[features]]:
            if col not in names:
                raise BadInputError(f"{f}: column {col!r} missing (needed for {features} features)")
        if "label" in names and not pa.types.is_integer(schema.field("label").type):
            raise BadInputError(f"{f}: column 'label' has type {schema.field('label').type}, expected an integer type")


# --------------------------------------------------------------------------- readers
class ShardReader:
    """Context manager yielding ``(inputs, labels)`` torch batches of one Parquet directory.

    ``engine``: ``native`` (default) or ``petastorm`` (Petastorm's ``make_batch_reader``,
    :mod:`pipeline.data.petastorm_engine`; ``mode`` does not apply; ``engine_options``: its
    settings, for benchmarks). Native ``mode``: ``memory``
    decodes the shard once per process and reshuffles it in memory every epoch; ``stream`` reads
    row groups in parallel with a bounded shuffle window; ``auto`` (the default) picks ``memory``
    when the decoded columns fit ``memory_budget`` bytes (default
    :func:`~pipeline.data.engines.default_memory_budget`). ``shuffle=False`` reads in file
    order (evaluation). ``with_ids=True`` yields ``(inputs, labels, sample_ids)``.
    ``limit_batches`` stops early and ``skip_batches`` drops the first batches (resuming
    mid-epoch); both keep the stream's content identical to an uninterrupted read with the same
    seed. ``progress()`` is called after each decoded row group (a worker's watchdog beat: opening
    a large shard, or skipping into it, is progress). A non-CPU ``device``, and the Petastorm engine
    on any device, get their batches through a :class:`~pipeline.data.prefetch.DevicePrefetcher`
    (background thread; on CUDA pinned memory and non-blocking copies).
    """

    def __init__(self, path: str, batch_size: int, features: str, seed: int = 0, shuffle: bool = True,
                 shuffle_buffer: int = 2048, scaling: Optional[dict] = None, device: Any = None,
                 with_ids: bool = False, mode: str = "auto", memory_budget: Optional[int] = None,
                 decode_threads: Optional[int] = None, prefetch: int = 2, engine: str = "native",
                 engine_options: Optional[dict] = None, progress: Optional[Callable[[], None]] = None):
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r}: expected {' or '.join(ENGINES)}")
        if mode not in ("auto", "memory", "stream"):
            raise ValueError(f"mode={mode!r}: expected auto, memory or stream")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.path, self.batch_size, self.features = path, int(batch_size), features
        self.with_ids = with_ids
        self.seed, self.shuffle, self.shuffle_buffer = int(seed), shuffle, int(shuffle_buffer)
        self.transform = make_transform(features, scaling)
        self.device = device
        self.engine, self.engine_options = engine, dict(engine_options or {})
        self.requested_mode, self.memory_budget = mode, memory_budget
        self.decode_threads, self.prefetch = decode_threads, int(prefetch)
        self.progress = progress
        self.columns = FEATURE_COLUMNS[features] + (["sample_id"] if with_ids else [])
        self.mode: Optional[str] = None
        self._engine = None
        self._handed_out: list = []

    def __enter__(self) -> "ShardReader":
        check_columns(self.path, self.features, extra=self.columns)
        if self.engine == "petastorm":
            from .petastorm_engine import PetastormShard

            self.mode = "petastorm"
            self._engine = PetastormShard(self.path, self.columns, self.shuffle_buffer, **self.engine_options)
            return self
        from .engines import MemoryShard, StreamShard, default_decode_threads, default_memory_budget
        from .parquet import decoded_bytes

        mode = self.requested_mode
        if mode == "auto":
            budget = self.memory_budget if self.memory_budget is not None else default_memory_budget()
            mode = "memory" if decoded_bytes(self.path, self.columns) <= budget else "stream"
        self.mode = mode
        if mode == "memory":
            self._engine = MemoryShard.load(self.path, self.columns, self.progress)
        else:
            self._engine = StreamShard(self.path, self.columns, self.shuffle_buffer,
                                       self.decode_threads or default_decode_threads(), self.progress)
        return self

    def __exit__(self, *exc) -> None:
        """Close every batch iterator handed out (their threads and Petastorm readers stop)."""
        for it in self._handed_out:
            it.close()
        self._handed_out.clear()
        self._engine = None

    def _batches(self, skip: int, limit: Optional[int]) -> Iterator[tuple]:
        for cols in self._engine.epoch(self.seed, self.batch_size, self.shuffle, skip, limit):
            inputs, y = self.transform(cols)
            yield (inputs, y, cols["sample_id"]) if self.with_ids else (inputs, y)

    def batches(self, skip_batches: int = 0, limit_batches: Optional[int] = None) -> Iterator[tuple]:
        if self._engine is None:
            raise RuntimeError("ShardReader.batches() outside its `with` block")
        it = self._batches(int(skip_batches), limit_batches)
        import torch

        device = torch.device(self.device if self.device is not None else "cpu")
        if device.type != "cpu" or self.engine == "petastorm":
            it = iter(DevicePrefetcher(it, device, depth=self.prefetch))
        self._handed_out.append(it)
        return it

    def __iter__(self):
        return self.batches()


def read_all(path: str, features: str, scaling: Optional[dict] = None, batch_size: int = 1024,
             rank: int = 0, world: int = 1) -> Iterator[tuple]:
    """Evaluation reading in file order. Rank r of ``world`` reads only its contiguous slice of the
    rows, ``[N r / world, N (r + 1) / world)``: the row groups that hold it are the only ones it
    decodes (the row counts come from the Parquet footers), so the ranks share the decoding."""
    from .parquet import decode_table, open_parquet, row_groups

    check_columns(path, features)
    transform = make_transform(features, scaling)
    columns = FEATURE_COLUMNS[features]
    groups = row_groups(path)
    n = sum(g.rows for g in groups)
    lo, hi = n * rank // world, n * (rank + 1) // world
    files: dict = {}
    start = 0
    for g in groups:
        end = start + g.rows
        if end > lo and start < hi:
            pf = files.get(g.file) or files.setdefault(g.file, open_parquet(g.file))
            a = max(lo, start) - start
            t = pf.read_row_group(g.index, columns=columns).slice(a, min(hi, end) - start - a)
            for off in range(0, t.num_rows, batch_size):
                yield transform(decode_table(t.slice(off, batch_size), columns, g.file))
        start = end
        if start >= hi:
            break


def count_rows(path: str) -> int:
    from .parquet import open_parquet, parquet_files

    return sum(open_parquet(f).metadata.num_rows for f in parquet_files(path))


def probe_shape(path: str, features: str) -> dict:
    """Input shape facts the model builder needs (image H/W/C, number of classes is separate)."""
    from .parquet import open_parquet, parquet_files

    files = parquet_files(path)
    if features != "image":
        return {}
    t = open_parquet(files[0]).read_row_group(0, columns=["height", "width", "channels"])
    return {"height": int(t.column("height")[0].as_py()), "width": int(t.column("width")[0].as_py()),
            "channels": int(t.column("channels")[0].as_py())}


def label_count(paths: Sequence[str]) -> int:
    """1 + the largest label found in the given directories (number of classes): from the row
    groups' statistics in the Parquet footers where they hold a maximum, else from the column."""
    import pyarrow.compute as pc

    from .parquet import open_parquet, parquet_files

    mx = 0
    for path in paths:
        for f in parquet_files(path):
            pf = open_parquet(f)
            md = pf.metadata
            j = next((k for k in range(md.num_columns) if md.schema.column(k).path == "label"), None)
            stats = [md.row_group(i).column(j).statistics for i in range(md.num_row_groups)] if j is not None else []
            if j is not None and all(st is not None and st.has_min_max for st in stats):
                mx = max([mx] + [int(st.max) for st in stats])
                continue
            col = pf.read(columns=["label"]).column("label")
            if len(col):
                mx = max(mx, int(pc.max(col).as_py()))
    return mx + 1