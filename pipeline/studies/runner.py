"""Run a study: every cell x seed through the real stages and launchers, then statistics, report,
plots and MLflow.

Output directory (``output``, default ``runs/studies/<name>``)::

    study.json                 the resolved study: cells, seeds, baseline
    data/<stage>-<key>/        datasets and shards, one per distinct stage config (``data_dir``)
    runs/<cell>/seed_<s>/      run.json (the resolved config), train/ (summary.json, metrics.jsonl,
                               model.pt), learning_curve.png, mlflow_run.json
    results.parquet            one row per run: factors, seed, metrics
    stats.parquet              per cell and metric: n, mean, std, 95% CI, Welch p against the baseline
    report.md, plots/*.png
    mlruns/                    the MLflow file store (unless tracking.uri is set)

Data stages are keyed by a hash of their config (inputs included, output excluded), so a
dataset or a shard layout is materialised once and reused by every cell, seed and rerun that
needs the same one. Cells run one after another (each needs the whole machine). A run is
finished when its ``train/summary.json`` exists (training writes its output atomically) and its
``run.json`` holds the same config; a rerun of the study skips finished runs, so an interrupted
study resumes where it stopped. With ``records: results/<name>`` each finished run also leaves a
record in the repository (:mod:`.records`); a rerun skips the recorded runs even where their run
directories are gone (another sitting, another machine), and the tables of docs/results.md are
generated from the records (:mod:`.tables`).

An ``s3://`` output (an S3-compatible object store, :mod:`pipeline.fs`): the study works in a
local directory (``work_dir``, default ``runs/studies/<name>``: the run configs and result files
read back, the data cache unless ``data_dir``, the MLflow file store unless ``tracking.uri``) and
publishes to the prefix. Each run's training writes its output to
``runs/<cell>/seed_<s>/train/`` on the store itself, committed with ``_COMPLETE`` (so its ranks may
run on any node); the driver reads back ``summary.json`` and ``metrics.jsonl`` and PUTs the run's
``mlflow_run.json`` and, last, ``run.json``. ``study.json``, the Parquet files, the plots and
``report.md`` (last) are one PUT each. A rerun takes a run as finished when its ``train/`` carries
``_COMPLETE`` and its ``run.json`` holds the same config; it reads that run's results back from the
store, so a study resumes from the store alone. On a cluster whose workers share no disk with the
driver, ``data_dir`` goes on the store too (:mod:`.workspace`).
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, PipelineError
from ..fs import Location, delete_tree, exists
from ..outputs import read_json, write_json
from ..redact import redact
from .grid import Cell, StudyPlan, digest, plan_study
from .publish import RemoteOutput
from .records import run_fingerprint
from .spec import METRICS, StudyConfig
from .study_report import write_outputs
from .workspace import StorePath, data_root_of, is_complete, open_workspace, parent_run, target_of, work_folder

log = logging.getLogger(__name__)

STAGE_OUT = {"simulate": "simulated", "ingest": "events", "features": "features", "shard": "shards"}


def study_target(spec: StudyConfig) -> Location:
    """Where the study's results go: a local directory or an object-store prefix."""
    return target_of(spec.output, f"runs/studies/{spec.name}")


def study_dir(spec: StudyConfig) -> Path:
    """The local directory the study works in (its output, or ``work_dir`` for an object-store output)."""
    return work_folder(spec.output, spec.work_dir, f"runs/studies/{spec.name}")


def _stage_fns(workflow: str) -> list[tuple[str, str, Callable]]:
    from ..shards.materialize import shard

    if workflow == "images":
        from ..ingest.images import ingest_images

        return [("ingest", "dataset", ingest_images), ("shard", "shards", shard)]
    from ..features.stage import build_features
    from ..ingest.root import ingest_root
    from ..simulate import generate

    return [("simulate", "simulated", generate), ("ingest", "events", ingest_root),
            ("features", "features", build_features), ("shard", "shards", shard)]


def stage_configs(run_cfg, workflow: str, p: dict) -> dict:
    from .. import workflows

    if workflow == "images":
        return workflows.images_stage_configs(run_cfg, p)
    return workflows.hep_stage_configs(run_cfg.model_copy(update={"real_samples": False}), p)


def _placeholder_paths(workflow: str) -> dict:
    from .. import workflows

    none = Path("/nonexistent")
    return workflows._paths(none) if workflow == "images" else workflows._hep_paths(none)


def stage_key(stage_cfg) -> str:
    return digest(stage_cfg.model_dump(mode="json", exclude={"output", "spark"}))


def data_paths(run_cfg, workflow: str, data_root: Path) -> tuple[dict, list[tuple[str, Any, Path]]]:
    """Keyed stage outputs for one run config: (paths, [(stage, stage config, output dir)])."""
    p = _placeholder_paths(workflow)
    todo = []
    for name, pkey, _ in _stage_fns(workflow):
        cfg = stage_configs(run_cfg, workflow, p)[name]
        out = data_root / f"{name}-{stage_key(cfg)}"
        p[pkey] = out
        todo.append((name, cfg.model_copy(update={"output": str(out)}), out))
    return p, todo


def prepare_data(run_cfg, workflow: str, data_root: Path, spark) -> dict:
    """Materialise the data stages a run needs (each only once); returns the stage paths."""
    fns = {name: fn for name, _, fn in _stage_fns(workflow)}
    p, todo = data_paths(run_cfg, workflow, data_root)
    for name, cfg, out in todo:
        if is_complete(out):
            continue
        log.info("study: %s -> %s", name, out)
        fns[name](cfg, spark)
    return p


def run_key(cell: Cell, seed: int) -> str:
    return f"runs/{cell.key}/seed_{seed}"


def run_dir(out: Path, cell: Cell, seed: int) -> Path:
    return out / run_key(cell, seed)


#: what the driver reads back of a run whose training wrote to the store (model.pt stays there)
RESULT_FILES = ("train/summary.json", "train/metrics.jsonl")


def fetch_finished(remote: RemoteOutput, cell: Cell, seed: int, rdir: Path, run_cfg) -> bool:
    """A run finished on the store (its training output committed, its ``run.json``, written last,
    holding the same config): its result files (and its MLflow marker) are copied into ``rdir``."""
    key = run_key(cell, seed)
    if not remote.committed(f"{key}/train") or not exists(remote.at(f"{key}/run.json")) or \
            read_json(str(remote.at(f"{key}/run.json"))).get("config") != run_fingerprint(run_cfg):
        return False
    shutil.rmtree(rdir, ignore_errors=True)
    remote.fetch([f"{key}/{f}" for f in ("run.json", *RESULT_FILES)], rdir.parents[2])
    remote.fetch([f"{key}/mlflow_run.json"], rdir.parents[2], optional=True)
    return True


def is_finished(rdir: Path, run_cfg) -> bool:
    f = rdir / "run.json"
    return ((rdir / "train" / "summary.json").is_file() and f.is_file()
            and read_json(f).get("config") == run_fingerprint(run_cfg))


def train_one(plan: StudyPlan, cell: Cell, seed: int, out: Path, data_root, spark,
              remote: RemoteOutput | None = None) -> dict:
    """Prepare the data of one run (cached) and train it; returns the training summary. With a store
    target the training writes its output there itself (wherever its ranks run) and the driver reads
    back the result files."""
    from ..train.launch import train

    train_cfg = prepare_run(plan, cell, seed, out, data_root, spark, remote)
    summary = train(train_cfg, spark)
    finish_run(plan, cell, seed, out, train_cfg, remote)
    return summary


def prepare_run(plan: StudyPlan, cell: Cell, seed: int, out: Path, data_root, spark,
                remote: RemoteOutput | None = None):
    """The data of one run (made once, cached), a fresh run folder with its ``run.json``; returns the
    run's training config."""
    spec = plan.spec
    run_cfg = plan.config(cell, seed)
    rdir = run_dir(out, cell, seed)
    key = run_key(cell, seed)
    p = prepare_data(run_cfg, spec.workflow, data_root, spark)
    p["train"] = StorePath(str(remote.at(key))) / "train" if remote else rdir / "train"
    train_cfg = stage_configs(run_cfg, spec.workflow, p)["train"]
    if rdir.exists():
        shutil.rmtree(rdir)  # an unfinished or outdated run starts again from scratch
    if remote:
        delete_tree(remote.at(key))
    write_json(rdir / "run.json", {"study": spec.name, "cell": cell.name, "factors": cell.factors, "seed": seed,
                                   "config": run_fingerprint(run_cfg),
                                   "train": redact(train_cfg.model_dump(mode="json"))})
    return train_cfg


def finish_run(plan: StudyPlan, cell: Cell, seed: int, out: Path, train_cfg,
               remote: RemoteOutput | None = None) -> None:
    """After a run trained: its checkpoints deleted (a finished run needs none), its result files read
    back from the store."""
    from ..train.checkpoint import clear as clear_checkpoints
    from ..train.launch import checkpoint_dir

    clear_checkpoints(checkpoint_dir(train_cfg))
    if remote:
        remote.fetch([f"{run_key(cell, seed)}/{f}" for f in RESULT_FILES], run_dir(out, cell, seed).parents[2])


def result_row(plan: StudyPlan, cell: Cell, seed: int, out: Path, remote: RemoteOutput | None = None) -> dict:
    from .results import run_metrics

    rdir = run_dir(out, cell, seed)
    row: dict = {"study": plan.spec.name, "cell": cell.name, "cell_key": cell.key, "seed": seed,
                 "baseline": plan.is_baseline(cell)}
    row.update({k: v for k, v in cell.factors.items()})
    row.update(run_metrics(rdir / "train", plan.spec.target_accuracy))
    row["run_dir"] = str(remote.at(run_key(cell, seed))) if remote else str(rdir)
    return row


class _Tracker:
    """MLflow for a study, or nothing when tracking is disabled."""

    def __init__(self, plan: StudyPlan, out: Path):
        spec = plan.spec
        params = {"workflow": spec.workflow, "base": spec.base or "", "seeds": plan.seeds,
                  "cells": len(plan.cells), "baseline": _baseline_names(plan), "metrics": spec.metrics,
                  "target_accuracy": spec.target_accuracy, "factors": list(plan.cells[0].factors)}
        self.parent, self.uri = parent_run(spec.tracking, out, spec.name, "mlflow_study.json", params,
                                           {"pipeline.study": spec.name})

    def child(self, plan: StudyPlan, cell: Cell, seed: int, out: Path, row: dict) -> None:
        if self.parent is None:
            return
        from .tracking import train_params

        rdir = run_dir(out, cell, seed)
        cfg = plan.config(cell, seed)
        params = {**{f"factor.{k}": v for k, v in cell.factors.items()}, "cell": cell.name, "seed": seed,
                  "workers": cfg.workers, "shard.scheme": cfg.shard.scheme,
                  **{f"train.{k}": v for k, v in train_params(cfg.train).items()}}
        metrics = {k: v for k, v in row.items() if k in METRICS or k.startswith("test_auc_")}
        self.parent.child(rdir / "mlflow_run.json", f"{cell.name} / seed {seed}", params, metrics, rdir / "train",
                          {"pipeline.cell": cell.name, "pipeline.seed": str(seed), "pipeline.study": plan.spec.name})

    def discard(self, out: Path, cell: Cell, seed: int) -> None:
        if self.parent is not None:
            self.parent.discard(run_dir(out, cell, seed) / "mlflow_run.json")

    def finish(self, artifacts: list[Path], status: str = "FINISHED") -> None:
        if self.parent is not None:
            self.parent.finish(artifacts, status=status)


class _Bookkeeping:
    """What one pass over a study's runs has done: the trained, skipped and failed runs, each run's
    result row (by its number in the study), and the records and store copies written on the way."""

    def __init__(self, plan: StudyPlan, out: Path, tracker, remote: RemoteOutput | None):
        from .records import records_root

        self.plan, self.out, self.tracker, self.remote = plan, out, tracker, remote
        self.root = records_root(plan.spec.records)
        self.done: dict = {"trained": [], "skipped": [], "failed": [], "rows": [], "records": {}}
        self.rows: dict[int, dict] = {}

    def skipped(self, i: int, cell: Cell, seed: int, tag: str, cfg) -> bool:
        """Book run ``i`` as skipped when it finished earlier (in the work folder or on the store) or
        has a record; False when it must be trained."""
        from .records import recorded

        plan, out, remote, root = self.plan, self.out, self.remote, self.root
        rdir = run_dir(out, cell, seed)
        if fetch_finished(remote, cell, seed, rdir, cfg) if remote else is_finished(rdir, cfg):
            self.done["skipped"].append((cell.name, seed))
            log.info("%s: finished earlier, skipped", tag)
            if root is not None and recorded(root, cell, seed, cfg) is None:
                _record(plan, cell, seed, out, root, cfg, None, None)  # finished before records were kept
            self.rows[i] = result_row(plan, cell, seed, out, remote)
            self.tracker.child(plan, cell, seed, out, self.rows[i])
            return True
        rec = recorded(root, cell, seed, cfg)
        if rec is None:
            return False
        self.done["skipped"].append((cell.name, seed))
        self.done["records"][(cell.name, seed)] = rec
        self.rows[i] = record_row(plan, cell, seed, rec)
        log.info("%s: recorded in %s, skipped", tag, root)
        return True

    def fail(self, cell: Cell, seed: int, tag: str, e: Exception) -> None:
        """Book a failed run: its error in ``<run>/error.txt`` (and on the store)."""
        rdir = run_dir(self.out, cell, seed)
        msg = " ".join(str(e).split())[:500] or type(e).__name__
        self.done["failed"].append((cell.name, seed, e, msg))
        rdir.mkdir(parents=True, exist_ok=True)
        (rdir / "error.txt").write_text(f"{type(e).__name__}: {msg}\n")
        log.error("%s: FAILED: %s: %s", tag, type(e).__name__, msg)
        if self.remote:
            self.remote.replace_with_file(run_key(cell, seed), rdir / "error.txt")

    def settle(self, i: int, cell: Cell, seed: int, tag: str, cfg, load0,
               outcome: Callable[[], tuple[dict, float]]) -> None:
        """Book one trained run: ``outcome()`` returns its summary and seconds, or raises its error."""
        from .records import load_avg

        plan, out, remote = self.plan, self.out, self.remote
        try:
            s, wall = outcome()
        except Exception as e:  # noqa: BLE001 - the other runs go on; reported at the end
            self.fail(cell, seed, tag, e)
            return
        self.done["trained"].append((cell.name, seed))
        log.info("%s: test accuracy %.4f, %.0f s, load average %s -> %s", tag, s["test_accuracy"], wall,
                 load0, load_avg())
        if self.root is not None:
            _record(plan, cell, seed, out, self.root, cfg, wall, load0)
        self.rows[i] = result_row(plan, cell, seed, out, remote)
        self.tracker.child(plan, cell, seed, out, self.rows[i])
        if remote:  # run.json last: the run counts as finished
            rdir = run_dir(out, cell, seed)
            remote.put_files(out, [f for f in (rdir / "mlflow_run.json", rdir / "run.json") if f.is_file()])

    def result(self) -> dict:
        self.done["rows"] = [self.rows[i] for i in sorted(self.rows)]
        return self.done


def _run_all(plan: StudyPlan, out: Path, data_root, spark, tracker, remote: RemoteOutput | None = None) -> dict:
    """Every run in order: skip the finished and the recorded ones, train the others; a failed run
    is recorded and the study goes on (its error is in ``<run>/error.txt``). With an object-store
    output, finished runs are read back from the store and each new one is published when it ends.
    With ``records``, each trained run's record is written as soon as it finishes (:mod:`.records`).
    With ``parallel_runs`` > 1 the runs to train go to that many processes (:mod:`.parallel`); each
    is recorded when it ends, in the study's order."""
    from .records import load_avg

    book = _Bookkeeping(plan, out, tracker, remote)
    pool = None
    if plan.spec.parallel_runs > 1:
        from .parallel import RunPool

        pool = RunPool(plan.spec.parallel_runs)
    inflight: list = []

    def collect(entry) -> None:
        i, cell, seed, tag, cfg, load0, prepared, fut, train_cfg = entry

        def outcome() -> tuple[dict, float]:
            s, seconds, pid = fut.result()
            log.info("%s: trained in process %d", tag, pid)
            finish_run(plan, cell, seed, out, train_cfg, remote)
            return s, prepared + seconds
        book.settle(i, cell, seed, tag, cfg, load0, outcome)

    try:
        for i, (cell, seed) in enumerate(plan.runs, 1):
            tag = f"[study {plan.spec.name}] run {i}/{len(plan.runs)}: {cell.name}, seed {seed}"
            cfg = plan.config(cell, seed)
            if book.skipped(i, cell, seed, tag, cfg):
                continue
            t1, load0 = time.time(), load_avg()
            tracker.discard(out, cell, seed)
            if pool is None:
                book.settle(i, cell, seed, tag, cfg, load0,
                            lambda: (train_one(plan, cell, seed, out, data_root, spark, remote), time.time() - t1))
                continue
            try:
                train_cfg = prepare_run(plan, cell, seed, out, data_root, spark, remote)
            except Exception as e:  # noqa: BLE001 - booked as this run's failure
                book.fail(cell, seed, tag, e)
                continue
            prepared = time.time() - t1   # the run's seconds: preparing it here plus training it there
            inflight.append((i, cell, seed, tag, cfg, load0, prepared, pool.submit(train_cfg), train_cfg))
            log.info("%s: training (%d at once)", tag, len(inflight))
            if len(inflight) >= pool.n:
                collect(inflight.pop(0))
        while inflight:
            collect(inflight.pop(0))
    finally:
        if pool is not None:
            pool.close()
    return book.result()


def _record(plan: StudyPlan, cell: Cell, seed: int, out: Path, root: Path, cfg, wall: float, load0) -> None:
    from .records import write_record
    from .results import load_curve, run_metrics

    train_dir = run_dir(out, cell, seed) / "train"
    path = write_record(root, plan.spec.name, cell, seed, cfg,
                        run_metrics(train_dir, plan.spec.target_accuracy), load_curve(train_dir), wall, load0,
                        cfg.train.launcher)
    log.info("[study %s] recorded %s", plan.spec.name, path)


def record_row(plan: StudyPlan, cell: Cell, seed: int, rec: dict) -> dict:
    """A results.parquet row from a run record (the run itself may have been trained elsewhere)."""
    row: dict = {"study": plan.spec.name, "cell": cell.name, "cell_key": cell.key, "seed": seed,
                 "baseline": plan.is_baseline(cell)}
    row.update(cell.factors)
    row.update(rec["metrics"])
    row["run_dir"] = ""
    return row


def _failure(plan: StudyPlan, failed: list, report: str) -> Exception:
    cell, seed, err, msg = failed[0]
    text = (f"study {plan.spec.name}: {len(failed)} of {len(plan.runs)} runs failed (the others are in "
            f"{report}); first: {cell}, seed {seed}: {type(err).__name__}: {msg}")
    return PipelineError(text) if isinstance(err, PipelineError) else RuntimeError(text)


def run_study(spec: StudyConfig, spark=None) -> dict:
    """Run (or resume) the whole study; returns a summary with the paths and what ran."""
    from ..spark import get_spark

    t0 = time.time()
    plan = plan_study(spec)
    if spec.parallel_runs > 1 and not target_of(spec.output, f"runs/studies/{spec.name}").is_local:
        raise ConfigError(f"study {spec.name}: parallel_runs={spec.parallel_runs} needs a local output, "
                          f"not {spec.output}")
    ws = open_workspace(spec.output, spec.work_dir, spec.data_dir, f"runs/studies/{spec.name}", spec.tracking,
                        "study.json")
    target, out, remote, data_root = ws.target, ws.out, ws.remote, ws.data_root
    write_json(out / "study.json", plan_summary(plan))
    tracker = _Tracker(plan, out)
    spark = spark or get_spark(spec.spark)
    try:
        done = _run_all(plan, out, data_root, spark, tracker, remote)
        artifacts = write_outputs(plan, done["rows"], out, done["records"]) if done["rows"] else []
        if remote:
            remote.put_files(out, [out / "study.json", *sorted(artifacts, key=lambda a: a.name == "report.md")])
    except BaseException:
        tracker.finish([], status="FAILED")
        raise
    tracker.finish(artifacts, status="FAILED" if done["failed"] else "FINISHED")
    trained, skipped = done["trained"], done["skipped"]
    summary = {"study": spec.name, "output": str(target), "runs": len(plan.runs), "trained": trained,
               "skipped": skipped, "failed": [(c, s, m) for c, s, _, m in done["failed"]],
               "seconds": round(time.time() - t0, 1), "results": str(target.child("results.parquet")),
               "report": str(target.child("report.md")), "mlflow": tracker.uri,
               "mlflow_run_id": getattr(tracker.parent, "run_id", None)}
    if done["failed"]:
        raise _failure(plan, done["failed"], summary["report"])
    return summary


def _baseline_names(plan: StudyPlan):
    """The baseline cell's name, or the list of names when each group has its own."""
    names = [c.name for c in plan.baseline_cells]
    return names[0] if len(names) == 1 else names


def plan_summary(plan: StudyPlan) -> dict:
    spec = plan.spec
    return {"study": spec.name, "workflow": spec.workflow, "seeds": plan.seeds,
            "baseline": _baseline_names(plan), "metrics": spec.metrics, "target_accuracy": spec.target_accuracy,
            "cells": [{"name": c.name, "key": c.key, "factors": c.factors, "overrides": c.overrides,
                       "baseline": plan.baselines[c.key].name}
                      for c in plan.cells], "runs": len(plan.runs)}


def dry_run(spec: StudyConfig) -> dict:
    """``--dry-run``: the cells, runs and distinct data stages, without starting anything."""
    plan = plan_study(spec)
    data_root = data_root_of(spec.data_dir, study_dir(spec))
    stages: dict[str, str] = {}
    for cell, seed in plan.runs:
        _, todo = data_paths(plan.config(cell, seed), spec.workflow, data_root)
        for name, _, path in todo:
            stages[str(path)] = name
    s = plan_summary(plan)
    s.update({"output": str(study_target(spec)), "data": sorted(stages),
              "layouts": sum(1 for v in stages.values() if v == "shard")})
    return s

