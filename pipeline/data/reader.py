"""A worker's shard directory -> Petastorm -> torch batches, seeded per (worker, epoch).

Pipeline of one epoch::

    make_batch_reader(worker dir, seed, shuffle_row_groups, shuffle_rows, reader_pool_type="dummy")
      -> petastorm.pytorch.BatchedDataLoader(batch_size, shuffling_queue_capacity)
      -> transform: columns -> (inputs tuple, labels)

Used with ``with``::

    with ShardReader(path, batch_size=32, features="image", seed=epoch_seed(s, w, e)) as batches:
        for inputs, labels in batches: ...

Determinism: the ``dummy`` reader pool reads row groups in the seeded order in this thread,
and the loader's shuffling buffer (which draws from torch's global RNG) runs under its own
RNG state seeded from the same seed, swapped in around every batch. So the batch sequence is
a pure function of (data, seed), the model's RNG stream is untouched, and a resumed run can
replay an epoch up to its checkpoint by skipping batches.

Features (``image`` | ``hlf`` | ``llf`` | ``inclusive``):

* image: ``image`` list<uint8> (flattened HWC) -> float32 /255, reshaped to NCHW.
* hlf: ``hlf`` (14) -> (x - mean) / std with ``scaling.json``.
* llf: ``llf`` (801*19, particle-major) -> (n, 801, 19) scaled per feature, padding kept 0 using
  ``n_particles``; inputs ``(x, n_particles)``.
* inclusive: inputs ``(llf, n_particles, hlf)``.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from ..errors import BadInputError
from ..outputs import local_path, uri

MANIFEST_FORMAT = "hep-pipeline-shards/1"
N_PARTICLES, N_PARTICLE_FEATURES = 801, 19
# petastorm 0.12 on pyarrow 14 warns about legacy pyarrow APIs on every read
warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\..*)?$")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
FEATURE_COLUMNS = {
    "image": ["image", "height", "width", "channels", "label"],
    "hlf": ["hlf", "label"],
    "llf": ["llf", "n_particles", "label"],
    "inclusive": ["llf", "n_particles", "hlf", "label"],
}


# --------------------------------------------------------------------------- manifest
@dataclass
class WorkerShard:
    worker: int
    path: str
    rows: int
    seed: int
    group: dict = field(default_factory=dict)


@dataclass
class Manifest:
    """The parts of the shard manifest that training needs (see COMMON contract)."""

    path: str
    source: str
    workers: list[WorkerShard]
    n_train_samples: int
    copies: int
    layout: dict
    eval: dict[str, str]
    raw: dict

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def overlap_epochs(self, target_epochs: int) -> int:
        """E_overlap = ceil(E_target / C): with C copies, every sample is still seen E_target times."""
        return max(1, math.ceil(target_epochs / self.copies))


def load_manifest(path: str) -> Manifest:
    """Read and check a shard manifest; BadInputError names the file and the key on problems."""
    p = local_path(path)
    if not p.is_file():
        raise BadInputError(f"shard manifest not found: {p}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise BadInputError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None

    def need(d: dict, key: str, where: str = ""):
        if not isinstance(d, dict) or key not in d:
            raise BadInputError(f"{p}: manifest key {where}{key!r} missing")
        return d[key]

    fmt = need(raw, "format")
    if fmt != MANIFEST_FORMAT:
        raise BadInputError(f"{p}: manifest format {fmt!r} is not {MANIFEST_FORMAT!r}")
    layout = need(raw, "layout")
    copies = int(layout.get("copies", 1)) if isinstance(layout, dict) else 1
    workers = []
    for i, w in enumerate(need(raw, "workers")):
        wp = need(w, "path", f"workers[{i}].")
        if not local_path(wp).is_dir():
            raise BadInputError(f"{p}: shard directory of worker {i} not found: {wp}")
        workers.append(WorkerShard(worker=int(need(w, "worker", f"workers[{i}].")), path=str(wp),
                                   rows=int(need(w, "rows", f"workers[{i}].")), seed=int(w.get("seed", i)),
                                   group=dict(w.get("group") or {})))
    if not workers:
        raise BadInputError(f"{p}: manifest lists no workers")
    if [w.worker for w in workers] != list(range(len(workers))):
        raise BadInputError(f"{p}: manifest workers must be numbered 0..{len(workers) - 1}")
    empty = [w.worker for w in workers if w.rows <= 0]
    if empty:
        raise BadInputError(f"{p}: worker {empty[0]} has an empty shard")
    ev = need(raw, "eval")
    if copies < 1 or copies > len(workers):
        raise BadInputError(f"{p}: layout copies={copies} must be in 1..{len(workers)}")
    return Manifest(path=str(p), source=str(raw.get("source", "")), workers=workers,
                    n_train_samples=int(need(raw, "n_train_samples")), copies=copies, layout=dict(layout),
                    eval={k: str(v) for k, v in ev.items() if v}, raw=raw)


def epoch_seed(base_seed: int, worker_seed: int, epoch: int) -> int:
    """The shuffling seed of one (worker, epoch): independent streams for every pair."""
    return int(np.random.SeedSequence([base_seed & 0xFFFFFFFF, worker_seed & 0xFFFFFFFF, epoch]).generate_state(1)[0])


# --------------------------------------------------------------------------- transforms
def load_scaling(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    p = local_path(path)
    if not p.is_file():
        raise BadInputError(f"scaling file not found: {p}")
    try:
        s = json.loads(p.read_text())
        for k in ("hlf", "llf"):
            if k in s:
                s[k] = {"mean": [float(x) for x in s[k]["mean"]], "std": [float(x) for x in s[k]["std"]]}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BadInputError(f"{p}: not a valid scaling.json ({type(e).__name__}: {e})") from None
    return s


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

    hs = scaler("hlf", 14) if features in ("hlf", "inclusive") else None
    ls = scaler("llf", N_PARTICLE_FEATURES) if features in ("llf", "inclusive") else None

    def hlf(b):
        x = b["hlf"].float()
        return (x - hs[0]) / hs[1] if hs else x

    def llf(b):
        x = b["llf"].float().reshape(-1, N_PARTICLES, N_PARTICLE_FEATURES)
        n = b["n_particles"].long().clamp(0, N_PARTICLES)
        if ls:
            x = (x - ls[0]) / ls[1]
            real = torch.arange(N_PARTICLES).unsqueeze(0) < n.unsqueeze(1)
            x = x * real.unsqueeze(-1)
        return x, n

    def image(b):
        h, w, c = int(b["height"][0]), int(b["width"][0]), int(b["channels"][0])
        x = b["image"].reshape(-1, h, w, c).permute(0, 3, 1, 2).float().div_(255.0)
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


def check_columns(path: str, features: str) -> None:
    """BadInputError naming the column when a shard lacks one the model needs."""
    import pyarrow.parquet as pq

    p = local_path(path)
    files = sorted(x for x in p.rglob("*.parquet")) if p.is_dir() else [p]
    if not files:
        raise BadInputError(f"{p}: no Parquet files")
    try:
        names = set(pq.read_schema(files[0]).names)
    except Exception as e:  # noqa: BLE001 - corrupt file
        raise BadInputError(f"{files[0]}: unreadable Parquet ({type(e).__name__})") from None
    for col in FEATURE_COLUMNS[features]:
        if col not in names:
            raise BadInputError(f"{p}: column {col!r} missing (needed for {features} features)")


# --------------------------------------------------------------------------- readers
class _IsolatedRng:
    """Runs callables under a private torch CPU RNG state (the loader's shuffling buffer)."""

    def __init__(self, seed: int):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.state = g.get_state()

    def call(self, fn):
        import torch

        saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            return fn()
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(saved)


class ShardReader:
    """Context manager yielding ``(inputs, labels)`` torch batches of one Parquet directory.

    ``shuffle=False`` reads in file order (evaluation). ``with_ids=True`` yields
    ``(inputs, labels, sample_ids)``. ``limit_batches`` stops early and
    ``skip_batches`` drops the first batches (resuming mid-epoch); both keep the stream's
    content identical to an uninterrupted read with the same seed.
    """

    def __init__(self, path: str, batch_size: int, features: str, seed: int = 0, shuffle: bool = True,
                 shuffle_buffer: int = 2048, scaling: Optional[dict] = None, device: Any = None,
                 with_ids: bool = False):
        self.path, self.batch_size, self.features = path, int(batch_size), features
        self.with_ids = with_ids
        self.seed, self.shuffle, self.shuffle_buffer = int(seed), shuffle, int(shuffle_buffer)
        self.transform = make_transform(features, scaling)
        self.device = device
        self._reader = None
        self._loader = None

    def __enter__(self) -> "ShardReader":
        from petastorm import make_batch_reader
        from petastorm.pytorch import BatchedDataLoader

        self._reader = make_batch_reader(
            uri(self.path), schema_fields=FEATURE_COLUMNS[self.features] + (["sample_id"] if self.with_ids else []),
            reader_pool_type="dummy",
            num_epochs=1, seed=self.seed, shuffle_row_groups=self.shuffle, shuffle_rows=self.shuffle)
        cap = self.shuffle_buffer if self.shuffle else 0
        self._loader = BatchedDataLoader(self._reader, batch_size=self.batch_size, shuffling_queue_capacity=cap)
        return self

    def __exit__(self, *exc) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader.join()
            self._reader = None

    def batches(self, skip_batches: int = 0, limit_batches: Optional[int] = None) -> Iterator[tuple]:
        rng = _IsolatedRng(self.seed)
        it = iter(self._loader)
        i = 0
        while limit_batches is None or i < limit_batches:
            try:
                raw = rng.call(lambda: next(it))
            except StopIteration:
                return
            if i >= skip_batches:
                inputs, y = self.transform(raw)
                if self.device is not None:
                    inputs = tuple(t.to(self.device, non_blocking=True) for t in inputs)
                    y = y.to(self.device, non_blocking=True)
                yield (inputs, y, raw["sample_id"]) if self.with_ids else (inputs, y)
            i += 1

    def __iter__(self):
        return self.batches()


def read_all(path: str, features: str, scaling: Optional[dict] = None, batch_size: int = 1024,
             rank: int = 0, world: int = 1) -> Iterator[tuple]:
    """Evaluation reading in file order; rank r of ``world`` keeps rows ``i % world == r``."""
    import torch

    offset = 0
    with ShardReader(path, batch_size, features, shuffle=False, scaling=scaling) as r:
        for inputs, y in r:
            n = y.shape[0]
            keep = (torch.arange(offset, offset + n) % world) == rank
            offset += n
            if world > 1:
                inputs = tuple(t[keep] for t in inputs)
                y = y[keep]
            if y.numel():
                yield inputs, y


def count_rows(path: str) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in sorted(Path(local_path(path)).rglob("*.parquet")))


def probe_shape(path: str, features: str) -> dict:
    """Input shape facts the model builder needs (image H/W/C, number of classes is separate)."""
    import pyarrow.parquet as pq

    files = sorted(Path(local_path(path)).rglob("*.parquet"))
    if not files:
        raise BadInputError(f"{path}: no Parquet files")
    if features != "image":
        return {}
    t = pq.ParquetFile(files[0]).read_row_group(0, columns=["height", "width", "channels"])
    return {"height": int(t.column("height")[0].as_py()), "width": int(t.column("width")[0].as_py()),
            "channels": int(t.column("channels")[0].as_py())}


def label_count(paths: Sequence[str]) -> int:
    """1 + the largest label found in the given directories (number of classes)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    mx = 0
    for path in paths:
        for f in sorted(Path(local_path(path)).rglob("*.parquet")):
            col = pq.read_table(f, columns=["label"]).column("label")
            if len(col):
                mx = max(mx, int(pc.max(col).as_py()))
    return mx + 1
