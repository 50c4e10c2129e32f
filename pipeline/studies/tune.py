"""Hyperparameter search (``jobs/tune.py``): Optuna proposes, Spark runs the trials.

The CERN pipeline's tuning step: many independent single-worker trainings scheduled in parallel
on the Spark executors. Optuna's ask-and-tell interface drives the search (``sampler``: ``grid``,
``random`` or ``tpe``); each round asks ``parallel`` trials, runs them as one Spark job of
``parallel`` tasks (one training each, ``launcher=local`` with one worker inside the task) and
tells Optuna their objective. Data stages are materialised on the driver before the trials
(cached like a study's, by config). Every trial is logged to MLflow as a child run of the tuning
run, like a study cell, and the best trial's training config is written as a YAML that
``jobs/train.py --config`` accepts.

The search space (``configs/tune/*.yaml``)::

    space:
      train.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
      train.batch_size: {type: categorical, choices: [32, 64, 128]}
      train.algorithm.params.period: {type: int, low: 1, high: 8}

Keys are keys of the workflow's run config, like a study's factors. Output (``output``)::

    trials/trial_<n>/train/   each trial's training output (summary.json, metrics.jsonl)
    trials.parquet            one row per trial: number, state, parameters, objective, metrics
    best.json, best_train.yaml
    optuna.journal            Optuna's storage: a rerun continues the same search
    mlruns/                   MLflow file store (unless tracking.uri is set)

An ``s3://`` output: the search works in a local directory (``work_dir``, default
``runs/tune/<name>``; the data cache unless ``data_dir``, the MLflow file store unless
``tracking.uri``) and publishes to the prefix (:mod:`pipeline.studies.publish`). Each trial's task
writes its training output to ``trials/trial_<n>/train/`` on the store itself (committed with
``_COMPLETE``), so a trial runs on any executor; its ``summary.json`` and ``metrics.jsonl`` come back
to the driver in the task's result row, never through the executor's disk. After every round the
driver PUTs each trial's ``train_config.json`` and ``mlflow_run.json`` and the journal; at the end
``trials.parquet``, ``best.json`` and ``best_train.yaml`` (its ``output`` is ``<prefix>/best/train``).
A rerun whose working directory has no journal reads the journal and the trials back from the
store and continues the same search. On a cluster whose workers share no disk with the driver,
``data_dir`` goes on the store too (:mod:`.workspace`).
"""
from __future__ import annotations

import io
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config import StageConfig
from ..errors import ConfigError
from ..committed import resolve
from ..fs import Location, exists, location, write_bytes
from ..outputs import write_json
from ..redact import redact
from ..train.config import TrackingConfig
from .grid import RUN_CONFIGS, apply_overrides, base_data, build_run_config
from .publish import RemoteOutput
from .spec import METRICS
from .workspace import StorePath, open_workspace, parent_run, target_of, work_folder

log = logging.getLogger(__name__)

Scalar = Union[bool, int, float, str, None]
FORCED = {"workers": 1, "train.launcher": "local"}


class SearchParam(BaseModel):
    """One dimension of the search space."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["float", "int", "categorical"] = Field(..., description="float | int | categorical")
    low: Optional[float] = Field(None, description="lower bound (float, int)")
    high: Optional[float] = Field(None, description="upper bound, inclusive (float, int)")
    log: bool = Field(False, description="sample on a log scale (low > 0)")
    step: Optional[float] = Field(None, description="grid step (int: default 1; float: needed by the grid sampler)")
    choices: Optional[list[Scalar]] = Field(None, description="the values (categorical)")

    @model_validator(mode="after")
    def _range(self):
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("categorical needs a non-empty list of choices")
            if self.low is not None or self.high is not None:
                raise ValueError("categorical takes choices, not low/high")
            return self
        if self.choices is not None:
            raise ValueError(f"{self.type} takes low/high, not choices")
        if self.low is None or self.high is None:
            raise ValueError(f"{self.type} needs low and high")
        if not self.low < self.high:
            raise ValueError(f"empty range: low={self.low:g} must be below high={self.high:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got low={self.low:g}")
        if self.step is not None and (self.step <= 0 or self.step > self.high - self.low):
            raise ValueError(f"step={self.step:g} must be in (0, high - low]")
        if self.log and self.step is not None:
            raise ValueError("log scale and step exclude each other")
        if self.type == "int" and any(v is not None and v != int(v) for v in (self.low, self.high, self.step)):
            raise ValueError("int bounds and step must be integers")
        return self

    def distribution(self):
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.type == "categorical":
            return CategoricalDistribution(self.choices)
        if self.type == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def grid(self, name: str) -> list:
        import numpy as np

        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.step is None:
            raise ConfigError(f"space.{name}: the grid sampler needs choices or a step for a float parameter")
        n = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        return [float(v) for v in np.round(self.low + self.step * np.arange(n), 12)]

    def corners(self) -> list:
        return list(self.choices) if self.type == "categorical" else (
            [int(self.low), int(self.high)] if self.type == "int" else [self.low, self.high])


class TuneConfig(StageConfig):
    """Config of ``jobs/tune.py``: a search space over a workflow's run config."""

    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="tuning run name")
    workflow: Literal["images", "hep"] = Field("images", description="which pipeline prepares the data")
    base: Optional[str] = Field(None, description="YAML of the workflow's run config the trials start from")
    fixed: dict[str, Any] = Field(default_factory=dict, description="dotted overrides applied to every trial")
    space: dict[str, SearchParam] = Field(..., description="dotted config key -> search dimension")
    sampler: Literal["grid", "random", "tpe"] = Field("tpe", description="grid | random | tpe")
    trials: int = Field(8, gt=0, description="number of trials (grid: at most the grid's size)")
    parallel: int = Field(2, gt=0, description="trials run at once, one Spark task each")
    seed: int = Field(0, ge=0, description="sampler seed")
    objective: str = Field("best_val_accuracy", description="results column to optimise: " + ", ".join(METRICS))
    direction: Literal["maximize", "minimize"] = Field("maximize", description="maximize | minimize")
    output: Optional[str] = Field(None, description="output directory, a local path or s3://bucket/prefix "
                                                    "(default runs/tune/<name>)")
    work_dir: Optional[str] = Field(None, description="local working directory of a search whose output is on "
                                                      "an object store (default runs/tune/<name>)")
    data_dir: Optional[str] = Field(None, description="cache of datasets and shards (default <output>/data)")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(enabled=True),
                                     description="MLflow (default: file store <output>/mlruns)")

    @model_validator(mode="after")
    def _check(self):
        if not self.space:
            raise ValueError("empty search space")
        if self.objective not in METRICS:
            raise ValueError(f"unknown objective {self.objective!r} (known: {', '.join(METRICS)})")
        forced = sorted(set(self.space) & set(FORCED))
        if forced:
            raise ValueError(f"space.{forced[0]} cannot be searched: trials are single-worker local trainings")
        return self


def tune_target(cfg: TuneConfig) -> Location:
    return target_of(cfg.output, f"runs/tune/{cfg.name}")


def tune_dir(cfg: TuneConfig) -> Path:
    """The local directory the search works in (its output, or ``work_dir`` for an object-store output)."""
    return work_folder(cfg.output, cfg.work_dir, f"runs/tune/{cfg.name}")


_TRIAL_FILES = ("train_config.json", "train/summary.json", "train/metrics.jsonl", "mlflow_run.json")
#: what a trial's task sends back to the driver: its training output's result files
_RESULT_FILES = {"summary": "summary.json", "metrics": "metrics.jsonl"}


def _fetch_search(remote: RemoteOutput, out: Path) -> None:
    """A working directory without a journal continues the search published on the store."""
    import optuna

    if (out / "optuna.journal").exists() or not exists(remote.at("optuna.journal")):
        return
    remote.fetch(["optuna.journal"], out)
    for name in optuna.study.get_all_study_names(_storage(out)):
        for t in optuna.load_study(study_name=name, storage=_storage(out)).get_trials(deepcopy=False):
            key = f"trials/trial_{t.number}"
            if remote.committed(f"{key}/train"):
                remote.fetch([f"{key}/{f}" for f in _TRIAL_FILES], out, optional=True)


def _publish_round(remote: Optional[RemoteOutput], out: Path, numbers: list[int]) -> None:
    if remote is None:
        return
    for n in numbers:  # the trial's train/ is on the store already, written by its task
        tdir = out / "trials" / f"trial_{n}"
        remote.put_files(out, [f for f in (tdir / "train_config.json", tdir / "mlflow_run.json") if f.is_file()])
    remote.put_files(out, [out / "optuna.journal"])


def _base(cfg: TuneConfig) -> dict:
    return apply_overrides(base_data(cfg.base, cfg.fixed), FORCED)


def trial_config(cfg: TuneConfig, base: dict, params: dict, where: str):
    return build_run_config(RUN_CONFIGS[cfg.workflow], apply_overrides(base, params), where)


def check_tune(cfg: TuneConfig) -> dict:
    """Validate every dimension at its bounds (or each choice); returns the base dict."""
    base = _base(cfg)
    trial_config(cfg, base, {}, f"tune {cfg.name}: base {cfg.base or '(defaults)'} + fixed")
    for name, p in cfg.space.items():
        for v in p.corners():
            trial_config(cfg, base, {name: v}, f"tune {cfg.name}: space.{name}={v!r}")
        if cfg.sampler == "grid":
            p.grid(name)
    return base


def plan_tune(cfg: TuneConfig) -> dict:
    """``--dry-run``: the checked space and what would run."""
    check_tune(cfg)
    grid = grid_space(cfg) if cfg.sampler == "grid" else None
    return {"tune": cfg.name, "sampler": cfg.sampler, "trials": n_trials(cfg, grid), "parallel": cfg.parallel,
            "objective": f"{cfg.direction} {cfg.objective}", "space": {k: v.model_dump(exclude_none=True)
                                                                      for k, v in cfg.space.items()},
            "output": str(tune_target(cfg)), "best_config": str(tune_target(cfg).child("best_train.yaml"))}


def grid_space(cfg: TuneConfig) -> dict:
    return {k: p.grid(k) for k, p in cfg.space.items()}


def n_trials(cfg: TuneConfig, grid: Optional[dict]) -> int:
    if grid is None:
        return cfg.trials
    return min(cfg.trials, math.prod(len(v) for v in grid.values()))


def make_sampler(cfg: TuneConfig, grid: Optional[dict], resumed: int = 0):
    """The Optuna sampler; a continued search (``resumed`` trials in the journal) gets the seed
    ``seed + resumed`` so that it does not draw the first trials' values again."""
    import optuna

    seed = cfg.seed + resumed
    if cfg.sampler == "grid":
        return optuna.samplers.GridSampler(grid, seed=seed)
    if cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, cfg.trials // 3)))


# ------------------------------------------------------------------------- trials on Spark
def _run_trials_task(batches):
    """mapInArrow body: train each trial of its partition (its output goes where its config says:
    the store, or a local or shared path); one result row per trial, carrying the result files."""
    import pyarrow as pa

    from ..fs import location, read_bytes
    from ..train.config import TrainConfig
    from ..train.launch import train

    schema = pa.schema([("trial", pa.int64()), ("error", pa.string()), ("started", pa.float64()),
                        ("finished", pa.float64()), *((k, pa.string()) for k in _RESULT_FILES)])
    for batch in batches:
        for row in batch.to_pylist():
            t0 = time.time()
            err, files = None, {}
            try:
                cfg = TrainConfig.model_validate_json(row["config"])
                train(cfg)
                out = location(cfg.output, output=True)
                files = {k: read_bytes(resolve(out.child(name))).decode() for k, name in _RESULT_FILES.items()}
            except Exception as e:  # noqa: BLE001 - reported to the driver, the other trials go on
                err = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:400]}"
            yield pa.RecordBatch.from_pylist(
                [{"trial": row["trial"], "error": err, "started": t0, "finished": time.time(), **files}],
                schema=schema)


def run_trials_on_spark(spark, trials: list[tuple[int, str]]) -> dict[int, dict]:
    """Train ``(trial number, TrainConfig JSON)`` pairs, one Spark task each; trial -> {error, started,
    finished (epoch seconds of the task's training), summary, metrics (the result files' text)}."""
    from ..spark import forward_s3_settings, spark_task, task_frame

    forward_s3_settings(spark)  # trials read their shards from, and write their output to, s3:// themselves
    df = task_frame(spark, trials, "trial long, config string")
    ddl = "trial long, error string, started double, finished double, " + \
        ", ".join(f"{k} string" for k in _RESULT_FILES)
    out = df.mapInArrow(spark_task(_run_trials_task), ddl).collect()
    return {r["trial"]: {k: r[k] for k in ("error", "started", "finished", *_RESULT_FILES)} for r in out}


# ------------------------------------------------------------------------- the search
def _storage(out: Path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(out / "optuna.journal")))


def _trial_row(cfg: TuneConfig, t, out: Path) -> dict:
    from .results import run_metrics

    row = {"trial": t.number, "state": t.state.name, "objective": t.value if t.value is not None else math.nan,
           **{f"param.{k}": v for k, v in t.params.items()}}
    tdir = out / "trials" / f"trial_{t.number}" / "train"
    if (tdir / "summary.json").is_file():
        row.update(run_metrics(tdir))
    row.update({"error": t.user_attrs.get("error"), "task_started": t.user_attrs.get("task_started"),
                "task_finished": t.user_attrs.get("task_finished")})
    return row


def tune(cfg: TuneConfig, spark=None) -> dict:
    """Run (or continue) the search; writes trials.parquet, best.json and best_train.yaml."""
    import optuna

    from ..spark import get_spark
    from .runner import prepare_data, stage_configs

    t0 = time.time()
    base = check_tune(cfg)
    ws = open_workspace(cfg.output, cfg.work_dir, cfg.data_dir, f"runs/tune/{cfg.name}", cfg.tracking,
                        "optuna.journal")
    target, out, remote, data_root = ws.target, ws.out, ws.remote, ws.data_root
    if remote:
        _fetch_search(remote, out)
    grid = grid_space(cfg) if cfg.sampler == "grid" else None
    total = n_trials(cfg, grid)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=_storage(out), study_name=cfg.name, direction=cfg.direction,
                                load_if_exists=True)
    study.sampler = make_sampler(cfg, grid, resumed=len(study.get_trials(deepcopy=False)))
    _fail_stale(study)
    tracker = _TuneTracker(cfg, out)
    spark = spark or get_spark(cfg.spark)
    dists = {k: p.distribution() for k, p in cfg.space.items()}
    try:
        while (done := _finished(study)) < total:
            asked = [study.ask(dists) for _ in range(min(cfg.parallel, total - done))]
            batch, configs = [], {}
            for t in asked:
                run_cfg = trial_config(cfg, base, t.params, f"tune {cfg.name}: trial {t.number}")
                p = prepare_data(run_cfg, cfg.workflow, data_root, spark)
                key = f"trials/trial_{t.number}"
                p["train"] = StorePath(str(remote.at(key))) / "train" if remote else out / key / "train"
                configs[t.number] = stage_configs(run_cfg, cfg.workflow, p)["train"]
                write_json(out / key / "train_config.json", redact(configs[t.number].model_dump(mode="json")))
                batch.append((t.number, configs[t.number].model_dump_json()))
            log.info("tune %s: trials %s of %d on Spark", cfg.name, ", ".join(str(t.number) for t in asked), total)
            res = run_trials_on_spark(spark, batch)
            for t in asked:
                _tell(cfg, study, t, res.get(t.number, {"error": "no result from Spark"}), out, configs, tracker)
            _publish_round(remote, out, [t.number for t in asked])
        best = write_tune_outputs(cfg, study, out, remote)
        if remote:
            remote.put_files(out, [out / "trials.parquet", out / "best.json", out / "best_train.yaml"])
    except BaseException:
        tracker.finish([], status="FAILED")
        raise
    tracker.finish([out / "trials.parquet", out / "best.json", out / "best_train.yaml"], best)
    summary = {"tune": cfg.name, "output": str(target if remote else out), "trials": total, "best": best,
               "best_config": str(remote.at("best_train.yaml") if remote else out / "best_train.yaml"),
               "seconds": round(time.time() - t0, 1)}
    return summary


def _finished(study) -> int:
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.FAIL))


def _fail_stale(study) -> None:
    """Trials left RUNNING by an interrupted earlier run are marked failed (their training never finished)."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)


def _tell(cfg: TuneConfig, study, t, res: dict, out: Path, configs: dict, tracker) -> None:
    from optuna.trial import TrialState

    from ..train.checkpoint import clear as clear_checkpoints
    from ..train.launch import checkpoint_dir
    from .results import run_metrics

    tdir = out / "trials" / f"trial_{t.number}" / "train"
    clear_checkpoints(checkpoint_dir(configs[t.number]))  # a finished trial needs none
    if res.get("error") is None and res.get("summary") is not None and not (tdir / "summary.json").is_file():
        tdir.mkdir(parents=True, exist_ok=True)  # the results came back with the task's row
        for k, name in _RESULT_FILES.items():
            (tdir / name).write_text(res[k])
    for k in ("started", "finished"):
        if res.get(k) is not None:
            t.set_user_attr(f"task_{k}", res[k])
    if res["error"] is None and (tdir / "summary.json").is_file():
        row = run_metrics(tdir)
        value = row[cfg.objective]
        if not math.isnan(value):
            study.tell(t, value)
            log.info("tune %s: trial %d %s -> %s %.4f", cfg.name, t.number, json.dumps(t.params), cfg.objective, value)
            tracker.trial(t, configs[t.number], row, tdir)
            return
        res = {"error": f"objective {cfg.objective} is NaN"}
    t.set_user_attr("error", res["error"])
    study.tell(t, state=TrialState.FAIL)
    log.warning("tune %s: trial %d %s failed: %s", cfg.name, t.number, json.dumps(t.params), res["error"])


def write_tune_outputs(cfg: TuneConfig, study, out: Path, remote: Optional[RemoteOutput] = None) -> dict:
    """trials.parquet, best.json and best_train.yaml (ConfigError when no trial finished)."""
    import pandas as pd
    import yaml

    from ..train.config import TrainConfig

    rows = [_trial_row(cfg, t, out) for t in study.get_trials(deepcopy=False)]
    buf = io.BytesIO()
    pd.DataFrame(rows).to_parquet(buf, index=False)
    write_bytes(location(out / "trials.parquet"), buf.getvalue())
    complete = [t for t in study.get_trials(deepcopy=False) if t.value is not None]
    if not complete:
        errs = [r["error"] for r in rows if r.get("error")]
        raise ConfigError(f"tune {cfg.name}: no trial finished ({errs[0] if errs else 'no trials'})")
    b = study.best_trial
    tdir = out / "trials" / f"trial_{b.number}" / "train"
    train_cfg = TrainConfig.model_validate(json.loads((tdir.parent / "train_config.json").read_text()))
    best_out = remote.at("best/train") if remote else out / "best" / "train"
    doc = train_cfg.model_copy(update={"output": str(best_out)}).model_dump(mode="json", exclude={"spark"})
    header = (f"# Best of tuning run {cfg.name}: trial {b.number}, {cfg.objective} = {b.value:.6g} "
              f"({cfg.direction}); parameters {json.dumps(b.params)}\n"
              f"# Train it with: .venv/bin/python -m jobs.train --config {out / 'best_train.yaml'}\n")
    write_bytes(location(out / "best_train.yaml"), (header + yaml.safe_dump(doc, sort_keys=False)).encode())
    best = {"trial": b.number, "value": b.value, "params": b.params, "objective": cfg.objective,
            "direction": cfg.direction,
            "train_dir": str(remote.at(f"trials/trial_{b.number}/train") if remote else tdir)}
    write_json(out / "best.json", best)
    return best


class _TuneTracker:
    def __init__(self, cfg: TuneConfig, out: Path):
        params = {"workflow": cfg.workflow, "base": cfg.base or "", "sampler": cfg.sampler, "trials": cfg.trials,
                  "parallel": cfg.parallel, "objective": f"{cfg.direction} {cfg.objective}",
                  "space": {k: v.model_dump(exclude_none=True) for k, v in cfg.space.items()}}
        self.parent, self.uri = parent_run(cfg.tracking, out, cfg.name, "mlflow_tune.json", params,
                                           {"pipeline.tune": cfg.name})

    def trial(self, t, train_cfg, row: dict, tdir: Path) -> None:
        if self.parent is None:
            return
        from .tracking import train_params

        params = {**{f"param.{k}": v for k, v in t.params.items()}, "trial": t.number,
                  **{f"train.{k}": v for k, v in train_params(train_cfg).items()}}
        metrics = {k: v for k, v in row.items() if k in METRICS}
        self.parent.child(tdir.parent / "mlflow_run.json", f"trial {t.number}", params, metrics, tdir,
                          {"pipeline.trial": str(t.number)})

    def finish(self, artifacts: list[Path], best: Optional[dict] = None, status: str = "FINISHED") -> None:
        if self.parent is not None:
            self.parent.finish(artifacts, {"best_value": best["value"]} if best else None, status=status)
