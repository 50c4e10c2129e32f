"""Launchers and the stage's Python API: ``train(cfg) -> summary``.

``train`` checks the inputs on the driver (manifest, shards, columns, batch size), computes
the run plan every worker follows (see ``make_plan``), then starts the SAME worker function
(``pipeline.train.loop.worker_entry``) with the configured launcher:

* ``horovod`` (default): ``horovod.spark.run(fn, num_proc=M, use_gloo=True)``: one Horovod
  process per Spark task; communicator ``horovod``.
* ``torch``: ``pyspark.ml.torch.distributor.TorchDistributor(num_processes=M, local_mode=...,
  use_gpu=<CUDA available>)``: torchrun processes; communicator ``torch`` (gloo/NCCL).
* ``local``: no Spark; M = 1 runs in this process with the single-process communicator,
  M > 1 spawns M local processes joined by torch.distributed (gloo).

Outputs: ``<output>/metrics.jsonl``, ``summary.json``, ``model.pt`` (written atomically: a
failed run leaves no output directory) and checkpoints in ``checkpoint_dir`` (default
``<output>-checkpoints``), which survive a failed run so that ``resume=true`` can continue.
The output and checkpoint directories must be on a file system every worker can reach
(local disk for one machine).

GPUs: a worker uses ``cuda:<local rank>`` when CUDA is available (``device=auto``), NCCL with
the torch launcher, and stages tensors through host memory for a CPU-only Horovod build.
On a Spark cluster give every task one GPU, e.g. ``--conf spark.executor.resource.gpu.amount=1
--conf spark.task.resource.gpu.amount=1 --conf spark.executor.resource.gpu.discoveryScript=
$SPARK_HOME/examples/src/main/scripts/getGpusResources.sh``; TorchDistributor is then
created with ``use_gpu=True`` automatically. ``device=cpu`` forces the unchanged CPU path.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Optional

from ..errors import BadInputError, ConfigError
from ..outputs import atomic_output_dir, local_path, write_json
from .config import TrainConfig, features_for

log = logging.getLogger(__name__)


def checkpoint_dir(cfg: TrainConfig) -> Path:
    if cfg.checkpoint_dir:
        return local_path(cfg.checkpoint_dir)
    out = local_path(cfg.output)
    return out.parent / f"{out.name}-checkpoints"


def _find_scaling(cfg: TrainConfig, source: str) -> Optional[str]:
    if cfg.scaling:
        return str(local_path(cfg.scaling))
    tried = []
    if source:
        s = local_path(source)
        tried = [s / "scaling.json", s.parent / "scaling.json"]
        for p in tried:
            if p.is_file():
                return str(p)
    raise BadInputError(f"scaling.json for model {cfg.model!r} not found (tried {', '.join(map(str, tried)) or 'nothing'};"
                        " set scaling=PATH)")


def make_plan(cfg: TrainConfig) -> dict:
    """Check inputs and compute what every worker follows (all integers known up front)."""
    from ..data.reader import check_columns, label_count, load_manifest, probe_shape

    man = load_manifest(cfg.manifest)
    m = man.num_workers
    if cfg.workers is not None and cfg.workers != m:
        raise ConfigError(f"invalid config value workers={cfg.workers}: the manifest {man.path} has {m} worker shards")
    if cfg.launcher == "local" and m > 1 and cfg.device == "cuda":
        raise ConfigError("invalid config value device='cuda' with launcher=local and several workers: use torch")
    features = features_for(cfg.model)
    for w in man.workers:
        check_columns(w.path, features)
    if "test" not in man.eval:
        raise BadInputError(f"{man.path}: manifest has no eval.test path")
    for split, path in man.eval.items():
        if not local_path(path).is_dir():
            raise BadInputError(f"{man.path}: eval.{split} directory not found: {path}")
        check_columns(path, features)
    min_rows = min(w.rows for w in man.workers)
    spe = min_rows // cfg.batch_size
    if spe < 1:
        raise ConfigError(f"invalid config value batch_size={cfg.batch_size}: larger than the smallest shard "
                          f"({min_rows} rows)")
    overlap_epochs = man.overlap_epochs(cfg.epochs)
    total = overlap_epochs * spe
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    global_batch = cfg.batch_size * m
    epoch_steps = max(1, math.ceil(man.n_train_samples / global_batch))  # one (global) epoch, any layout
    eval_every = cfg.eval_every or epoch_steps
    num_classes = label_count([w.path for w in man.workers] + list(man.eval.values()))
    if features in ("hlf", "llf", "inclusive"):
        num_classes = max(num_classes, 3)
    return {
        "workers": m, "features": features, "num_classes": num_classes,
        "shape": probe_shape(man.workers[0].path, features), "copies": man.copies,
        "steps_per_epoch": spe, "overlap_epochs": overlap_epochs, "total_steps": total,
        "eval_every": eval_every, "epoch_steps": epoch_steps,
        "warmup_steps": int(round(cfg.warmup_epochs * epoch_steps)),
        "global_batch": global_batch, "n_train_samples": man.n_train_samples,
        "scaling": _find_scaling(cfg, man.source) if features != "image" else None,
        "eval": dict(man.eval), "manifest": man.path,
    }


def plan_train(cfg: TrainConfig) -> dict:
    """``--dry-run``: inputs, outputs and the step plan, without starting Spark or workers."""
    plan = make_plan(cfg)
    return {"inputs": [plan["manifest"]], "outputs": [str(local_path(cfg.output)), str(checkpoint_dir(cfg))],
            "launcher": cfg.launcher, **{k: plan[k] for k in ("workers", "steps_per_epoch", "overlap_epochs",
                                                               "total_steps", "eval_every", "warmup_steps")}}


# ---------------------------------------------------------------------------- launchers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_child(rank: int, world: int, port: int, args: tuple, queue) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from .loop import worker_entry

    try:
        queue.put((rank, worker_entry(*args), None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, f"{type(e).__name__}: {e}"))


def _run_local(args: tuple, world: int) -> list[dict]:
    from .loop import worker_entry

    if world == 1:
        cfg_json, _, plan, out, ck = args
        return [worker_entry(cfg_json, "local", plan, out, ck)]
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    argv = (args[0], "torch") + tuple(args[2:])
    procs = [ctx.Process(target=_local_child, args=(r, world, port, argv, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world):
        rank, res, err = queue.get()
        results[rank] = res
        if err:
            errors.append(f"rank {rank}: {err}")
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return [results[r] for r in range(world)]


def _run_horovod(args: tuple, world: int, cfg: TrainConfig, spark) -> list[dict]:
    import horovod.spark

    from ..spark import get_spark
    from .loop import worker_entry

    spark = spark or get_spark(cfg.spark)
    return horovod.spark.run(worker_entry, args=args, num_proc=world, use_gloo=True,
                             start_timeout=cfg.start_timeout, verbose=0)


def _run_torch(args: tuple, world: int, cfg: TrainConfig, spark) -> list[dict]:
    import torch
    from pyspark.ml.torch.distributor import TorchDistributor

    from ..spark import get_spark
    from .loop import worker_entry

    spark = spark or get_spark(cfg.spark)
    use_gpu = torch.cuda.is_available() and cfg.device != "cpu"
    res = TorchDistributor(num_processes=world, local_mode=cfg.torch_local_mode, use_gpu=use_gpu).run(
        worker_entry, *args)
    return [res]


def run_workers(cfg: TrainConfig, plan: dict, out_dir: str, ckpt_dir: str, spark=None) -> list[dict]:
    """Start the workers with the configured launcher; rank-ordered results (torch: rank 0 only)."""
    backend = {"horovod": "horovod", "torch": "torch", "local": "local"}[cfg.launcher]
    args = (cfg.model_dump_json(), backend, plan, out_dir, ckpt_dir)
    if cfg.launcher == "horovod":
        return _run_horovod(args, plan["workers"], cfg, spark)
    if cfg.launcher == "torch":
        return _run_torch(args, plan["workers"], cfg, spark)
    return _run_local(args, plan["workers"])


def train(cfg: TrainConfig, spark=None) -> dict:
    """Train on the shards of ``cfg.manifest``; return the summary (also ``<output>/summary.json``)."""
    cfg = cfg.model_copy(update={"manifest": str(local_path(cfg.manifest))})
    plan = make_plan(cfg)
    ck = checkpoint_dir(cfg)
    if not cfg.resume and ck.exists():
        shutil.rmtree(ck)  # a fresh run never mixes with an older run's checkpoints
    ck.mkdir(parents=True, exist_ok=True)
    if cfg.resume:  # refuse a changed config here, before any worker starts
        from . import checkpoint

        last = checkpoint.latest(str(ck))
        if last is not None:
            checkpoint.load(last, checkpoint.fingerprint(cfg, plan["workers"]))
    final = local_path(cfg.output)
    log.info("training %s with %s on %d workers (%s): %d steps, %d pass(es) over each shard, validation every %d",
             cfg.model, cfg.algorithm.name, plan["workers"], cfg.launcher, plan["total_steps"],
             plan["overlap_epochs"], plan["eval_every"])
    t0 = time.time()
    with atomic_output_dir(final) as tmp:
        results = run_workers(cfg, plan, str(tmp), str(ck), spark)
        r0 = results[0]
        summary = {
            "test_accuracy": r0["test_accuracy"], "test_loss": r0["test_loss"], "auc": r0["auc"],
            "model": cfg.model, "algorithm": cfg.algorithm.name, "launcher": cfg.launcher,
            "workers": plan["workers"], "steps": r0["steps"], "samples_processed": r0["samples_processed"],
            "overlap_epochs": plan["overlap_epochs"], "copies": plan["copies"], "eval_every": plan["eval_every"],
            "train_seconds": r0["train_seconds"], "seconds": time.time() - t0, "device": r0["device"],
            "comm": [r["comm"] for r in r0["ranks"]],
            "final_digests": [r["final_digest"] for r in r0["ranks"]],
            "metrics": str(final / "metrics.jsonl"), "model_path": str(final / "model.pt"),
            "checkpoint": (str(r0["checkpoint"]) if r0.get("checkpoint") else None), "checkpoint_dir": str(ck),
        }
        write_json(tmp / "summary.json", summary)
    log.info("test accuracy %.4f after %d steps in %.1f s", summary["test_accuracy"], summary["steps"],
             summary["seconds"])
    summary["ranks"] = r0["ranks"]  # per-rank details (digests, comm stats); not in summary.json
    return summary
