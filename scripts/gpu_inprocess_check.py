"""The ``inprocess`` launcher on CUDA, without Spark, Java or Petastorm: one line with the verdict.

On a host with torch built for CUDA it writes a small synthetic shard set with pyarrow alone (2
workers: learnable 14-float rows for the HLF classifier, 28x28 images with a class-dependent bright
block for LeNet-5; the shard manifest written with the project's own model), then trains every run of
``RUNS`` twice with the in-process launcher at the same seed: on the CPU (``device=cpu``) and on the GPU
(``device=cuda``, the ranks' models and collectives on CUDA). The synchronous algorithms run on the
ranks' threads; the asynchronous ones (EA-wild, AD-PSGD, the parameter server) and time-budgeted local
SGD with a straggler under the simulated clock. A run passes when its summary says it trained on CUDA
and its test accuracy is within ``--tolerance`` of the CPU run's. The CUDA run of one simulated case is
repeated to report whether CUDA gave the same run to the bit (information, not part of the verdict:
some CUDA kernels are not deterministic).

    bash scripts/gpu_inprocess_check.sh [--steps 100] [--tolerance 0.03] [--workdir DIR]

Exit 0 only when every run passed; without a CUDA device one line saying so, exit 1, nothing run.
``--device-under-test cpu`` runs the same comparison CPU against CPU (to check the script itself on a
host without a GPU).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NEEDED = {"torch": "torch", "numpy": "numpy", "pyarrow": "pyarrow", "pydantic": "pydantic", "yaml": "pyyaml",
          "sklearn": "scikit-learn", "psutil": "psutil", "tqdm": "tqdm"}
# (name, model, batch, algorithm, extra config): 2 in-process workers each
RUNS = [
    ("hlf/arsgd", "hlf", 128, {"name": "arsgd"}, {}),
    ("lenet5/arsgd", "lenet5", 32, {"name": "arsgd"}, {}),
    ("lenet5/swarm", "lenet5", 32, {"name": "swarm", "params": {"local_steps": 2}}, {}),
    ("lenet5/eawild-sim", "lenet5", 32, {"name": "eawild", "params": {"round_steps": 8}}, {}),
    ("lenet5/adpsgd-sim", "lenet5", 32, {"name": "adpsgd", "params": {"round_steps": 8}}, {}),
    ("hlf/async_ps-sim", "hlf", 128, {"name": "async_ps", "params": {"round_steps": 8}}, {}),
    ("hlf/timed_local_sgd-straggler-sim", "hlf", 128,
     {"name": "timed_local_sgd", "params": {"round_seconds": 0.08, "nominal_steps": 8}},
     {"stragglers": {"slowdown": {1: 2.0}}}),
]
REPEATED = "hlf/async_ps-sim"


def missing_packages() -> list[str]:
    return [pip for mod, pip in NEEDED.items() if importlib.util.find_spec(mod) is None]


def _manifest(root: Path, name: str, tables: list, evals: dict, n_train: int) -> Path:
    """Worker folders and eval splits of pyarrow tables, and the manifest (the project's model)."""
    import pyarrow.parquet as pq

    from pipeline.shards.manifest import ShardManifest

    base = root / name
    entries = []
    for w, t in enumerate(tables):
        d = base / f"worker_{w:03d}"
        d.mkdir(parents=True)
        pq.write_table(t, d / "part-00000.parquet", row_group_size=512)
        ids = t.column("sample_id").to_pylist()
        entries.append({"worker": w, "path": str(d.resolve()), "files": ["part-00000.parquet"], "rows": t.num_rows,
                        "sample_ids": [[min(ids), max(ids)]], "seed": 1000 + w, "group": {}})
    ev = {}
    for split, t in evals.items():
        d = base / "eval" / split
        d.mkdir(parents=True)
        pq.write_table(t, d / "part-00000.parquet", row_group_size=512)
        ev[split] = str(d.resolve())
    m = ShardManifest(source=f"synthetic-{name}", layout={"scheme": "disjoint", "workers": len(tables), "copies": 1,
                                                           "seed": 0},
                      n_train_samples=n_train, row_group_rows=512, eval=ev, workers=entries)
    m.write(base / "manifest.json")
    return base / "manifest.json"


def _split(n_train: int, n_eval: int, make) -> tuple[list, dict]:
    """Two disjoint worker tables of ``n_train`` rows in all, val and test of ``n_eval`` rows each;
    ``make(ids, split)`` builds a table of the rows ``ids``."""
    import numpy as np

    ids = np.arange(n_train)
    tables = [make(part, "train") for part in np.array_split(ids, 2)]
    evals = {"val": make(np.arange(n_train, n_train + n_eval), "val"),
             "test": make(np.arange(n_train + n_eval, n_train + 2 * n_eval), "test")}
    return tables, evals


def hlf_shards(root: Path, n_train: int = 8192, n_eval: int = 2048) -> tuple[Path, Path]:
    """14-float rows, 3 classes shifted apart (learnable, not trivially), and a unit scaling.json."""
    import numpy as np
    import pyarrow as pa

    from pipeline.features.scaling import ScalingFile

    rng = np.random.default_rng(0)
    n = n_train + 2 * n_eval
    y = rng.integers(0, 3, n)
    centres = rng.normal(size=(3, 14)).astype(np.float32)
    x = rng.normal(size=(n, 14)).astype(np.float32) * 1.5 + centres[y]

    def make(ids, split):
        return pa.table({"sample_id": pa.array(ids.astype(np.int64)), "label": pa.array(y[ids].astype(np.int64)),
                         "split": pa.array([split] * len(ids)),
                         "hlf": pa.array(list(x[ids]), pa.list_(pa.float32()))})

    manifest = _manifest(root, "hlf", *_split(n_train, n_eval, make), n_train)
    scaling = root / "scaling.json"
    scaling.write_text(ScalingFile(hlf={"mean": [0.0] * 14, "std": [1.0] * 14},
                                   llf={"mean": [0.0] * 19, "std": [1.0] * 19}).model_dump_json())
    return manifest, scaling


def image_shards(root: Path, n_train: int = 4096, n_eval: int = 1024) -> Path:
    """28x28 grey images, 10 classes: a bright 7x7 block at a class-dependent place, noise around it;
    15% of the labels replaced by random ones (so accuracy stays below 1 and can tell runs apart)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(1)
    n = n_train + 2 * n_eval
    y = rng.integers(0, 10, n)
    img = rng.integers(0, 120, size=(n, 28, 28)).astype(np.uint8)
    for i in range(n):
        r, c = divmod(int(y[i]), 4)
        r0, c0 = 2 + 8 * r + rng.integers(-2, 3), 1 + 7 * c + rng.integers(-2, 3)
        img[i, max(0, r0):r0 + 7, max(0, c0):c0 + 7] = rng.integers(110, 220)
    y = np.where(rng.random(n) < 0.15, rng.integers(0, 10, n), y)

    def make(ids, split):
        k = len(ids)
        return pa.table({"sample_id": pa.array(ids.astype(np.int64)), "label": pa.array(y[ids].astype(np.int64)),
                         "image": pa.array([img[i].reshape(-1) for i in ids], type=pa.list_(pa.uint8())),
                         "height": pa.array(np.full(k, 28, np.int32)), "width": pa.array(np.full(k, 28, np.int32)),
                         "channels": pa.array(np.full(k, 1, np.int32)), "split": pa.array([split] * k)})

    return _manifest(root, "images", *_split(n_train, n_eval, make), n_train)


def train_once(root: Path, tag: str, manifest: Path, scaling, model: str, batch: int, algorithm: dict, extra: dict,
               device: str, steps: int) -> dict:
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    out = root / "runs" / tag
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(f"{out}-checkpoints", ignore_errors=True)
    cfg = TrainConfig(manifest=str(manifest), output=str(out), launcher="inprocess", model=model, batch_size=batch,
                      epochs=50, max_steps=steps, eval_every=max(8, steps // 2), optimizer="adam", lr=0.001,
                      device=device, progress=False, seed=0, algorithm=algorithm,
                      scaling=str(scaling) if scaling else None, **extra)
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "w") as log, contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
        s = train(cfg)          # the run's progress and validation lines go to <workdir>/runs/<run>.log
    return {"device": s["device"], "accuracy": s["test_accuracy"], "final_digests": s["final_digests"],
            "simulated": "simulated_clock" in s["ranks"][0], "seconds": round(time.time() - t0, 2)}


def check(root: Path, steps: int, tolerance: float, under_test: str) -> tuple[bool, list[str], dict]:
    hlf, scaling = hlf_shards(root)
    images = image_shards(root)
    ok, parts, details = True, [], {}
    for name, model, batch, algorithm, extra in RUNS:
        manifest, sc = (hlf, scaling) if model == "hlf" else (images, None)
        tag = name.replace("/", "-")
        cpu = train_once(root, f"{tag}-cpu", manifest, sc, model, batch, algorithm, extra, "cpu", steps)
        dut = train_once(root, f"{tag}-{under_test}", manifest, sc, model, batch, algorithm, extra, under_test, steps)
        good = under_test in dut["device"] and abs(dut["accuracy"] - cpu["accuracy"]) <= tolerance
        ok &= good
        parts.append(f"{name} cpu {cpu['accuracy']:.4f} {under_test} {dut['accuracy']:.4f}"
                     f"{'' if good else ' FAIL'}")
        details[name] = {"cpu": cpu, under_test: dut, "pass": good}
        if name == REPEATED:
            again = train_once(root, f"{tag}-{under_test}-again", manifest, sc, model, batch, algorithm, extra,
                               under_test, steps)
            same = again["final_digests"] == dut["final_digests"]
            details[name]["repeat_bit_identical"] = same
            parts.append(f"{name} repeated on {under_test}: {'bit-identical' if same else 'not bit-identical'}")
    return ok, parts, details


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="training steps per run (each worker)")
    p.add_argument("--tolerance", type=float, default=0.03, help="largest |CUDA - CPU| test accuracy")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, removed after)")
    p.add_argument("--device-under-test", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: compare CPU with CPU (checks this script on a host without a GPU)")
    a = p.parse_args(argv)
    missing = missing_packages()
    if missing:
        print(f"gpu-inprocess-check: missing Python packages {', '.join(missing)}; install them with "
              f"pip install {' '.join(missing)} (no Spark, Java or Petastorm needed); nothing was run", file=sys.stderr)
        return 1
    import torch

    if a.device_under_test == "cuda" and not torch.cuda.is_available():
        print("gpu-inprocess-check: no CUDA device visible (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr)
        return 1
    dev = torch.cuda.get_device_name(0) if a.device_under_test == "cuda" else "cpu"
    t0 = time.time()
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="gpu-inprocess-check-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        ok, parts, details = check(root, a.steps, a.tolerance, a.device_under_test)
        err = None
    except Exception as e:  # noqa: BLE001 - reported on the one line
        ok, parts, details = False, [], {}
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    verdict = "PASS" if ok else "FAIL"
    line = [f"gpu-inprocess-check: {verdict} ({'every run trained on ' + a.device_under_test + ' and its test accuracy is within ' + format(a.tolerance, 'g') + ' of the CPU run' if ok else 'see the runs marked FAIL'})",
            f"device {dev}", f"torch {torch.__version__}"] + parts
    if err:
        line.append(f"ERROR {err}")
    line.append(f"{time.time() - t0:.0f} s")
    print(" | ".join(line))
    (root / "gpu_inprocess_check.json").write_text(json.dumps({"device": dev, "verdict": verdict, "error": err,
                                                               "runs": details}, indent=1))
    if not a.workdir and ok:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
