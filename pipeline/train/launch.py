"""Launchers and the stage's Python API: ``train(cfg) -> summary``.

``train`` checks the inputs on the driver (manifest, shards, columns, batch size), computes
the run plan every worker follows (see ``make_plan``), then starts the SAME worker function
(``pipeline.train.entry.worker_entry``) with the configured launcher:

* ``horovod`` (default): ``horovod.spark.run(fn, num_proc=M, use_gloo=True)``: one Horovod
  process per Spark task; communicator ``horovod``.
* ``torch``: ``pyspark.ml.torch.distributor.TorchDistributor(num_processes=M, local_mode=...,
  use_gpu=...)``: torchrun processes; communicator ``torch`` (gloo/NCCL).
* ``local``: no Spark; M = 1 runs in this process with the single-process communicator,
  M > 1 spawns M local processes joined by torch.distributed (gloo); a process that dies is
  noticed within a second and the others are stopped (no wait on a dead peer).

Before a Spark launch the cluster's task slots are checked (``pipeline.spark.check_task_slots``).
A lost worker relaunches the workers from the newest complete checkpoint, up to
``max_restarts`` times (``pipeline.train.restart``); ``resume`` (false | true | auto) decides
where the first launch starts.

Outputs: ``<output>/metrics.jsonl``, ``summary.json`` (with ``restarts`` and ``resumed_from``),
``model.pt`` and checkpoints in ``checkpoint_dir`` (default ``<output>-checkpoints``; per-rank
files, see ``checkpoint``), which survive a failed run so that a resume can continue. Every rank
writes what it owns straight to the output's filesystem, wherever it runs: its checkpoint files,
and on rank 0 ``metrics.jsonl`` and ``model.pt``, under a job-scoped temporary sibling of the
output; the driver adds ``summary.json`` and commits (the rename of a local or shared directory,
``_COMPLETE`` on an object store), so a failed run leaves no output. Output and checkpoints must
be reachable by every worker: a local disk for one machine, a shared file system or an ``s3://``
prefix for a cluster (a local output that rank 0 wrote on another machine's disk ends the run
with one line). Both targets are checked before any work starts (``pipeline.fs.check_writable``).

GPUs: a Horovod-on-Spark worker uses the GPU Spark assigned to its task (``task_gpu``: the
task's ``gpu`` resource), other workers ``cuda:<local rank>`` among the visible devices
(TorchDistributor sets ``CUDA_VISIBLE_DEVICES`` per task). TorchDistributor's ``use_gpu``
comes from the config (``torch_use_gpu``): ``device=cuda`` -> True, ``cpu`` -> False, ``auto``
-> whether Spark gives the processes GPUs (``spark.task.resource.gpu.amount``, the driver's
amount in local mode), never from whether the driver sees CUDA. On a cluster give every task
one GPU, e.g. ``--conf spark.executor.resource.gpu.amount=1 --conf spark.task.resource.gpu.amount=1
--conf spark.executor.resource.gpu.discoveryScript=$SPARK_HOME/examples/src/main/scripts/getGpusResources.sh``.
"""
from __future__ import annotations

import logging
import math
import os
import posixpath
import time
from pathlib import Path
from typing import Optional

from ..errors import BadInputError, ConfigError
from ..commit import ATTEMPTS, output_job
from ..fs import Location, check_writable, exists, list_files, location
from ..paths_overlap import check_apart, overlaps
from .config import TrainConfig, features_for
from .gpus import check_torch_gpus, task_gpu, torch_use_gpu
from .local_launchers import run_inprocess, run_local
from .plan import TrainingPlan
from .lr_schedule import plan_terms

log = logging.getLogger(__name__)


def checkpoint_dir(cfg: TrainConfig) -> Location:
    """``checkpoint_dir`` or ``<output>-checkpoints`` (local or on an object store)."""
    from .checkpoint import location_of

    if cfg.checkpoint_dir:
        return location_of(cfg.checkpoint_dir)
    out = location(cfg.output, output=True)
    return location_of(out.sibling(f"{out.name}-checkpoints"))


def check_targets(cfg: TrainConfig) -> tuple[Location, Location]:
    """The output and checkpoint locations, checked before any work: the output neither inside nor
    holding the shard folder (the manifest's) or ``checkpoint_dir`` (symlinks and ``..`` resolved,
    :mod:`pipeline.paths_overlap`); an unsupported scheme, a bucket that does not exist, missing
    credentials or a read-only prefix is one line naming the URI."""
    final = location(cfg.output, output=True)
    ck = checkpoint_dir(cfg)
    for loc in (final, ck):
        check_writable(location(loc))
    man = location(cfg.manifest)
    check_apart(final, [Location(man.scheme, posixpath.dirname(man.path.rstrip("/")))], input_name="shard_folder")
    if overlaps(final, ck):
        raise ConfigError(f"invalid config value checkpoint_dir={cfg.checkpoint_dir!r}: it overlaps the output {final} "
                          "(committing the output replaces that directory); use a directory of its own")
    return final, ck


def _find_scaling(cfg: TrainConfig, source: str) -> Optional[str]:
    if cfg.scaling:
        return str(location(cfg.scaling))
    tried = []
    if source:
        s = location(source)
        tried = [s.child("scaling.json")] + ([] if s.is_bucket_root else [s.sibling("scaling.json")])
        for p in tried:
            if (Path(p.path).is_file() if p.is_local else exists(p)):
                return str(p)
    raise BadInputError(f"scaling.json for model {cfg.model!r} not found (tried {', '.join(map(str, tried)) or 'nothing'};"
                        " set scaling=PATH)")


def model_for_shards(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the model its shards call for when none was given: the built-in default
    (``lenet5``) reads images, so shards of HEP features (``hlf`` rows, as ``make run`` writes them
    under the default manifest) train the HLF classifier instead. A given model is kept as it is."""
    if "model" in cfg.model_fields_set:
        return cfg
    from ..data.parquet import parquet_files, read_parquet_schema
    from ..shards.manifest import load_manifest

    man = load_manifest(cfg.manifest)
    names = set(read_parquet_schema(parquet_files(man.workers[0].path)[0]).names) if man.workers else set()
    if "image" in names or "hlf" not in names:
        return cfg
    log.info("model: hlf (the shards of %s hold HEP features; set model to choose another)", man.path)
    return cfg.model_copy(update={"model": "hlf"})


def make_plan(cfg: TrainConfig) -> dict:
    """Check inputs and compute what every worker follows (all integers known up front)."""
    from ..data.shard_reader import check_columns, label_count, probe_shape
    from ..extras import require
    from ..shards.manifest import load_manifest, shard_dir_exists

    man = load_manifest(cfg.manifest)
    m = man.num_workers
    if cfg.workers is not None and cfg.workers != m:
        raise ConfigError(f"invalid config value workers={cfg.workers}: the manifest {man.path} has {m} worker shards")
    from .algorithms.async_common import check_world

    check_world(cfg.algorithm.name, cfg.algorithm.params, m)
    if cfg.launcher == "local" and m > 1 and cfg.device == "cuda":
        raise ConfigError("invalid config value device='cuda' with launcher=local and several workers: use torch")
    if cfg.launcher == "local" and m == 1 and cfg.debug.fail_mode == "hang" and cfg.debug.fail_at_step:
        raise ConfigError("invalid config value debug.fail_mode='hang' with launcher=local and one worker: it runs "
                          "inside this process, without a watchdog to end it; use several workers or another launcher")
    features = features_for(cfg.model)
    for w in man.workers:
        check_columns(w.path, features)
    if "test" not in man.eval:
        raise BadInputError(f"{man.path}: manifest has no eval.test path")
    for split, path in man.eval.items():
        if not shard_dir_exists(path):
            raise BadInputError(f"{man.path}: eval.{split} directory not found: {path}")
        check_columns(path, features)
    min_rows = min(w.rows for w in man.workers)
    overlap_epochs = man.overlap_epochs(cfg.epochs)

    def total_steps(b: int) -> int:
        return min(overlap_epochs * (min_rows // b), cfg.max_steps or math.inf)

    terms = plan_terms(cfg, man.layout, m, total_steps)  # batch rule, lr scaling, step decay
    b = terms["batch_size"]
    spe = min_rows // b
    if spe < 1:
        raise ConfigError(f"invalid config value batch_size={cfg.batch_size}: a worker batch of {b} is larger "
                          f"than the smallest shard ({min_rows} rows)")
    total = total_steps(b)
    global_batch = b * m
    epoch_steps = max(1, math.ceil(man.n_train_samples / global_batch))  # one (global) epoch, any layout
    eval_every = cfg.eval_every or epoch_steps
    num_classes = label_count([w.path for w in man.workers] + list(man.eval.values()))
    if features in ("hlf", "llf", "inclusive"):
        num_classes = max(num_classes, 3)
    if num_classes < 2:
        raise BadInputError(f"{man.path}: the shards and eval splits hold {num_classes} class label(s); "
                            "a classifier needs at least 2")
    if cfg.launcher == "horovod":             # after the input checks: a bad input is named first
        require("horovod")
    if cfg.loader.engine == "petastorm":
        require("petastorm")
    return _validated_plan(man.path, {
        "workers": m, "features": features, "num_classes": num_classes,
        "shape": probe_shape(man.workers[0].path, features), "copies": man.copies,
        "steps_per_epoch": spe, "overlap_epochs": overlap_epochs, "total_steps": total,
        "eval_every": eval_every, "epoch_steps": epoch_steps,
        "warmup_steps": int(round(cfg.warmup_epochs * epoch_steps)), **terms,
        "global_batch": global_batch, "n_train_samples": man.n_train_samples,
        "scaling": _find_scaling(cfg, man.source) if features != "image" else None,
        "eval": dict(man.eval), "manifest": man.path,
    })


def _validated_plan(manifest: str, fields: dict) -> dict:
    """The plan as the TrainingPlan contract; an inconsistent one is one line naming the field."""
    from pydantic import ValidationError

    try:
        return TrainingPlan(**fields).model_dump()
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"]) or "plan"
        raise BadInputError(f"{manifest}: no valid training plan: {key}: {err['msg']}") from None


def plan_train(cfg: TrainConfig) -> dict:
    """``--dry-run``: inputs, outputs and the step plan, without starting Spark or workers."""
    cfg = model_for_shards(cfg)
    plan = make_plan(cfg)
    return {"inputs": [plan["manifest"]], "outputs": [str(location(cfg.output, output=True)), str(checkpoint_dir(cfg))],
            "launcher": cfg.launcher, "model": cfg.model,
            **{k: plan[k] for k in ("workers", "steps_per_epoch", "overlap_epochs", "total_steps", "eval_every",
                                    "warmup_steps")}}


# ---------------------------------------------------------------------------- launchers
def _with_assigned_gpu(*args):
    """A Horovod-on-Spark worker: :func:`~pipeline.train.entry.worker_entry` on the GPU Spark assigned."""
    from .entry import worker_entry

    return worker_entry(*args, assigned_gpu=task_gpu())


def _run_horovod(args: tuple, world: int, cfg: TrainConfig, spark) -> list[dict]:
    import horovod.spark

    from ..spark import get_spark

    spark = spark or get_spark(cfg.spark, min_task_slots=world)
    _check_slots(spark, world)
    from .progress import worker_env

    _task_environment(spark)
    nics = None
    if cfg.bind_address:   # Horovod's gloo traffic on the interface of the configured address
        from .comm.rendezvous import bind_address, interface_of

        nics = {interface_of(bind_address(cfg.bind_address, cfg.bind_address))}
    # env: what the tasks add to their own environment (the progress channel)
    return horovod.spark.run(_with_assigned_gpu, args=args, num_proc=world, use_gloo=True,
                             start_timeout=cfg.start_timeout, verbose=0, nics=nics, env=worker_env() or None)


def _run_torch(args: tuple, world: int, cfg: TrainConfig, spark) -> list[dict]:
    from pyspark.ml.torch.distributor import TorchDistributor

    from ..spark import get_spark
    from .comm.rendezvous import new_run_secret

    spark = spark or get_spark(cfg.spark, min_task_slots=world)
    if runs_in_spark_tasks(cfg):
        _check_slots(spark, world)
        _task_environment(spark)
    conf = dict(spark.sparkContext.getConf().getAll())
    use_gpu = torch_use_gpu(cfg.device, cfg.torch_local_mode, conf)
    if use_gpu:
        check_torch_gpus(world, cfg.torch_local_mode, conf)
    # the run's secret travels with the function's arguments (through Spark, like Horovod's key), not in an
    # environment: the workers sign their keys in torchrun's store with it (comm/rendezvous.py)
    res = TorchDistributor(num_processes=world, local_mode=cfg.torch_local_mode, use_gpu=use_gpu).run(
        _with_run_secret, new_run_secret(), *args)
    return [res]


def _with_run_secret(secret: str, *args):
    """A TorchDistributor worker: :func:`~pipeline.train.entry.worker_entry` with the run's secret."""
    from .comm.rendezvous import RUN_SECRET_ENV
    from .entry import worker_entry

    os.environ[RUN_SECRET_ENV] = secret
    return worker_entry(*args)


def _task_environment(spark) -> None:
    """The workers run in Spark tasks (and in the processes Horovod and TorchDistributor start
    from them, which inherit the tasks' environment): give them the driver's S3 settings."""
    from ..spark import forward_s3_settings

    forward_s3_settings(spark)


def _check_slots(spark, world: int) -> None:
    """Fail at once when the cluster has fewer task slots than workers."""
    from ..spark import check_task_slots

    check_task_slots(spark, world)


def runs_in_spark_tasks(cfg: TrainConfig) -> bool:
    """Whether the configured launcher runs the workers as Spark tasks, one task slot each: Horovod,
    and TorchDistributor outside its local mode."""
    return cfg.launcher == "horovod" or (cfg.launcher == "torch" and not cfg.torch_local_mode)


def check_launch_slots(cfg: TrainConfig, spark) -> None:
    """A workflow's first check, before the stages that precede training: when the workers will run
    as Spark tasks, fail with the slot error now instead of after ingestion and sharding. The
    training stage checks again at its start; a Spark Connect session is left to its refusal of
    these launchers."""
    from ..spark import is_connect

    if cfg.workers is not None and runs_in_spark_tasks(cfg) and not is_connect(spark):
        _check_slots(spark, cfg.workers)


def run_workers(cfg: TrainConfig, plan: dict, out_dir: str, ckpt_dir: str, spark=None) -> list[dict]:
    """Start the workers with the configured launcher; rank-ordered results (torch: rank 0 only).
    Rank 0's progress and validation lines are shown by this driver (``progress.relay``)."""
    from .progress import relay

    backend = {"horovod": "horovod", "torch": "torch", "local": "local", "inprocess": "inprocess"}[cfg.launcher]
    args = (cfg.model_dump_json(), backend, plan, out_dir, ckpt_dir)
    if cfg.launcher == "inprocess":
        with relay(True, cfg.bind_address or "127.0.0.1"):
            return run_inprocess(args, plan["workers"])
    if cfg.launcher == "local":
        with relay(True, cfg.bind_address or "127.0.0.1"):
            return run_local(args, plan["workers"], host=cfg.bind_address)
    from ..spark import get_spark, require_classic

    spark = spark or get_spark(cfg.spark, min_task_slots=plan["workers"])
    require_classic(spark, f"launcher={cfg.launcher}")
    with relay(True, cfg.bind_address or spark.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")):
        if cfg.launcher == "horovod":
            return _run_horovod(args, plan["workers"], cfg, spark)
        return _run_torch(args, plan["workers"], cfg, spark)


def train(cfg: TrainConfig, spark=None) -> dict:
    """Train on the shards of ``cfg.manifest``; return the summary (also ``<output>/summary.json``).
    A lost worker is relaunched from the newest complete checkpoint (``restart.supervise``)."""
    from . import checkpoint, restart

    final, ck = check_targets(cfg)
    cfg = model_for_shards(cfg.model_copy(update={"manifest": str(location(cfg.manifest))}))
    plan = make_plan(cfg)
    if ck.is_local:
        Path(ck.path).mkdir(parents=True, exist_ok=True)
    fp = checkpoint.fingerprint(cfg, plan["workers"])
    start = restart.start_checkpoint(cfg, ck, fp)  # refuses a changed config before any worker starts
    log.info("training %s with %s on %d workers (%s): %d steps, %d pass(es) over each shard, validation every %d",
             cfg.model, cfg.algorithm.name, plan["workers"], cfg.launcher, plan["total_steps"],
             plan["overlap_epochs"], plan["eval_every"])
    t0 = time.time()
    with output_job(final) as job:   # the ranks write into the job's prefix directly, wherever they run
        launches: list[str] = []

        def launch(attempt_cfg, resume_from):
            launches.append(launch_dir(len(launches)))
            return run_workers(attempt_cfg, {**plan, "resume_from": resume_from}, str(job.staging.child(launches[-1])),
                               str(ck), spark)

        results, restarts = restart.supervise(launch, cfg, ck, fp, start)
        _keep_rank0_files(job, launches[-1])
        restart.record_restarts(job.kept()["metrics.jsonl"], restarts)
        summary = _summary(cfg, plan, results[0], final, ck, time.time() - t0)
        summary.update({"resumed_from": str(start) if start else None, "restarts": restarts})
        job.write_json("summary.json", summary)
    if results[0].get("checkpoint"):   # only once the output is committed: a later fresh start may delete it
        try:
            checkpoint.mark_finished(results[0]["checkpoint"])
        except (OSError, BadInputError) as e:   # the output stands; the checkpoint just stays resumable
            log.warning("could not mark checkpoint %s as finished (%s): a plain rerun will keep it and say how to "
                        "continue it", results[0]["checkpoint"], e)
    log.info("test accuracy %.4f after %d steps in %.1f s%s", summary["test_accuracy"], summary["steps"],
             summary["seconds"], f" ({len(restarts)} restart(s))" if restarts else "")
    summary["ranks"] = results[0]["ranks"]  # per-rank details (digests, comm stats); not in summary.json
    return summary


def launch_dir(launch: int) -> str:
    """Where rank 0 of the ``launch``-th launch of the workers writes, inside the job's prefix.

    The run's files are written by one writer, rank 0, like one task of a Spark stage: a launch is
    an attempt of that task (:mod:`pipeline.commit`'s attempt-scoped names, with stage -1: not a
    Spark stage). A relaunch after a lost worker writes a fresh directory, so a lost launch's
    partial ``metrics.jsonl`` or ``model.pt`` is never committed."""
    return f"{ATTEMPTS}/s-1-p0-a{launch}-t-1"


def _keep_rank0_files(job, attempt_dir: str) -> None:
    """Commit what rank 0 wrote in the last launch; it must have written ``metrics.jsonl`` and
    ``model.pt`` where the driver reads them. A local output that rank 0 wrote on another machine's
    disk (a cluster without a shared filesystem) is not there: one line, nothing committed."""
    where = job.staging.child(attempt_dir)
    files = [posixpath.relpath(f.path, where.path) for f in list_files(where)]
    missing = [f for f in ("metrics.jsonl", "model.pt") if f not in files]
    if missing:
        verb = "are" if len(missing) > 1 else "is"
        raise ConfigError(f"output {job.final}: rank 0 reported success but its {' and '.join(missing)} {verb} not "
                          f"under {where} as the driver sees it: rank 0 ran on a machine that does not share this "
                          "path; write the output to a filesystem every node mounts or to an s3:// prefix")
    job.add([{"attempt_dir": attempt_dir, "files": files}])


def _summary(cfg: TrainConfig, plan: dict, r0: dict, final: Location, ck, seconds: float) -> dict:
    return {
        "test_accuracy": r0["test_accuracy"], "test_loss": r0["test_loss"], "auc": r0["auc"],
        "model": cfg.model, "algorithm": cfg.algorithm.name, "launcher": cfg.launcher,
        "workers": plan["workers"], "steps": r0["steps"], "samples_processed": r0["samples_processed"],
        "overlap_epochs": plan["overlap_epochs"], "copies": plan["copies"], "eval_every": plan["eval_every"],
        "train_seconds": r0["train_seconds"], "seconds": seconds, "device": r0["device"],
        # collective traffic per rank, plus the point-to-point payload of the asynchronous algorithms
        "comm": [{**r["comm"], **{k: r[k] for k in ("p2p_bytes_sent", "p2p_messages") if k in r}}
                 for r in r0["ranks"]],
        "final_digests": [r["final_digest"] for r in r0["ranks"]],
        "metrics": str(final.child("metrics.jsonl")), "model_path": str(final.child("model.pt")),
        "checkpoint": (str(r0["checkpoint"]) if r0.get("checkpoint") else None), "checkpoint_dir": str(ck),
        # what some algorithms add: rounds of round-driven runs, <name>_test_accuracy of extra evaluations
        **{k: v for k, v in r0.items() if k == "rounds" or k.endswith("_test_accuracy")},
        # under the simulated clock: virtual seconds, communication share and bytes per link of the run
        **({"simulated_clock": r0["ranks"][0]["simulated_clock"]}
           if r0.get("ranks") and r0["ranks"][0].get("simulated_clock") else {}),
    }
