"""MLflow tracking of studies, tuning runs and plain training runs (all from the driver).

* A study (or a tuning run) is one **parent run** in the experiment named after it; every cell x
  seed (or trial) is a **child run** (tag ``mlflow.parentRunId``) with its parameters (the factor
  values, the seed and the main training settings), one metric point per evaluation of
  ``metrics.jsonl`` (``val_accuracy``, ``val_loss``, ``train_loss``, ``samples_per_s``, ...,
  at the evaluation's step), the final metrics of ``results.parquet``, and as artifacts
  ``metrics.jsonl`` (the learning curve), ``summary.json`` and ``learning_curve.png``.
* A plain training run (``jobs/train.py`` with ``tracking.enabled=true``) is one run of the
  experiment ``tracking.experiment`` (default ``train``) with the same content.

The default store is MLflow's file store in ``mlruns/`` (under the study's output, or next to a
training run's output); ``tracking.uri`` takes any MLflow tracking URI (``sqlite:///...``,
``http://host:5000``, ...). MLflow 3 refuses the file store unless ``MLFLOW_ALLOW_FILE_STORE``
is true; it is set for file stores only. Which run belongs to which study run is remembered in
``mlflow_run.json`` files next to the outputs, so a resumed study logs every run exactly once.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError
from ..outputs import local_path, read_json, write_json
from ..redact import redact

log = logging.getLogger(__name__)

RUN_FILE = "mlflow_run.json"
CURVE_KEYS = ("accuracy", "loss", "train_loss", "samples_per_s", "comm_fraction", "bytes_sent",
              "consensus_distance")
TRAIN_PARAMS = ("model", "algorithm", "launcher", "workers", "epochs", "batch_size", "batch_rule", "optimizer", "lr",
                "momentum", "weight_decay", "init", "lr_scaling", "warmup_epochs", "warmup_optimizer", "lr_decay_at",
                "augment", "seed", "max_steps")


def store_uri(uri: Optional[str], default_dir: Path) -> str:
    """The tracking URI: ``uri``, else a file store at ``default_dir``."""
    if uri:
        return uri
    return "file://" + str(local_path(default_dir))


def client(uri: str):
    """An ``MlflowClient`` for ``uri`` (ConfigError naming the URI if MLflow cannot open it)."""
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        c = MlflowClient(tracking_uri=uri)
        c.search_experiments(max_results=1)  # opens the store now, so a bad URI fails here
    except (MlflowException, ImportError, ValueError) as e:
        raise ConfigError(redact(f"tracking.uri={uri!r}: {str(e).splitlines()[0]}")) from None
    return c


def experiment_id(c, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    return exp.experiment_id if exp is not None else c.create_experiment(name)


def _params(d: dict) -> list:
    from mlflow.entities import Param

    return [Param(str(k)[:250], json.dumps(v, default=str) if not isinstance(v, str) else v[:6000])
            for k, v in d.items()]


def train_params(train_cfg) -> dict:
    d = train_cfg.model_dump(mode="json")
    out = {k: d[k] for k in TRAIN_PARAMS if k in d}
    out["algorithm"] = d["algorithm"]["name"]
    out["algorithm.params"] = d["algorithm"]["params"]
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def curve_metrics(curve: list[dict]) -> list:
    """One MLflow metric per evaluation record and key, at the record's step: ``val_accuracy``,
    ``val_loss``, ``train_loss``, ``samples_per_s``, ... (the final test record: ``test_accuracy``,
    ``test_loss``)."""
    from mlflow.entities import Metric

    out = []
    for i, r in enumerate(curve):
        split, step = r.get("split", "eval"), int(r.get("step", i))
        ts = int(1000 * float(r.get("wall_s") or i))
        keys = ("accuracy", "loss") if split == "test" else CURVE_KEYS + ("epoch",)
        for k in keys:
            if _finite(r.get(k)):
                name = f"{split}_{k}" if k in ("accuracy", "loss", "epoch") else k
                out.append(Metric(name, float(r[k]), ts, step))
    return out


def _final_metrics(row: dict) -> list:
    from mlflow.entities import Metric

    return [Metric(f"final_{k}", float(v), 0, 0) for k, v in row.items() if _finite(v)]


def log_run(c, exp_id: str, name: str, params: dict, row: dict, train_dir: Path, parent: Optional[str] = None,
            tags: Optional[dict] = None, plot_dir: Optional[Path] = None) -> str:
    """One finished training run as an MLflow run; returns its run id. The learning-curve PNG is
    written to ``plot_dir`` (kept) or to a temporary directory."""
    from ..report.curves import ReportConfig, report
    from .results import load_curve

    train_dir = Path(train_dir)
    t = {"mlflow.runName": name, **(tags or {})}
    if parent:
        t["mlflow.parentRunId"] = parent
    run = c.create_run(exp_id, run_name=name, tags=t)
    rid = run.info.run_id
    try:
        curve = load_curve(train_dir)
        metrics = curve_metrics(curve) + _final_metrics(row)
        for i in range(0, max(len(metrics), 1), 900):  # MLflow's batch limit is 1000 metrics
            c.log_batch(rid, metrics=metrics[i:i + 900], params=_params(params) if i == 0 else [])
        for f in ("metrics.jsonl", "summary.json"):
            if (train_dir / f).is_file():
                c.log_artifact(rid, str(train_dir / f))
        if any(r.get("split") == "val" for r in curve):
            with tempfile.TemporaryDirectory(prefix="curve-") as tmp:
                png = Path(plot_dir or tmp) / "learning_curve.png"
                report(ReportConfig(runs=[str(train_dir)], output=str(png), labels=[name], title=name))
                c.log_artifact(rid, str(png))
        c.set_terminated(rid, "FINISHED")
    except BaseException:
        c.set_terminated(rid, "FAILED")
        raise
    return rid


def logged_run(path: Path) -> Optional[str]:
    """The MLflow run id remembered in ``path`` (``mlflow_run.json``), if any."""
    p = Path(path)
    return read_json(p).get("run_id") if p.is_file() else None


def remember_run(path: Path, uri: str, run_id: str) -> None:
    """``path`` remembers the run (its tracking URI without credentials: :func:`pipeline.redact.redact`)."""
    write_json(path, {"tracking_uri": redact(uri), "run_id": run_id})


def _same_store(path: Path, uri: str) -> bool:
    """``path`` (``mlflow_run.json``) names a run of the store ``uri``."""
    return read_json(path).get("tracking_uri") == redact(uri)


class ParentRun:
    """The parent run of a study or tuning run, reopened when the study resumes."""

    def __init__(self, uri: str, experiment: str, name: str, state_file: Path, params: dict, tags: dict):
        self.uri, self.state_file = uri, Path(state_file)
        self.c = client(uri)
        self.exp_id = experiment_id(self.c, experiment)
        rid = logged_run(self.state_file)
        if rid is not None and _same_store(self.state_file, uri) and self._exists(rid):
            self.c.update_run(rid, status="RUNNING")
        else:
            run = self.c.create_run(self.exp_id, run_name=name, tags={"mlflow.runName": name, **tags})
            rid = run.info.run_id
            self.c.log_batch(rid, params=_params(params))
            remember_run(self.state_file, uri, rid)
        self.run_id = rid

    def _exists(self, rid: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.c.get_run(rid)
            return True
        except MlflowException:
            return False

    def child(self, marker: Path, name: str, params: dict, row: dict, train_dir: Path, tags: dict) -> str:
        """Log one finished run under this parent unless ``marker`` says it already is."""
        rid = logged_run(marker)
        if rid is not None and _same_store(marker, self.uri) and self._exists(rid):
            return rid
        rid = log_run(self.c, self.exp_id, name, params, row, train_dir, parent=self.run_id, tags=tags,
                      plot_dir=Path(train_dir).parent)
        remember_run(marker, self.uri, rid)
        return rid

    def discard(self, marker: Path) -> None:
        """Delete the child run remembered in ``marker`` (its training is about to be redone)."""
        rid = logged_run(marker)
        if rid is not None and _same_store(marker, self.uri) and self._exists(rid):
            self.c.delete_run(rid)

    def finish(self, artifacts: list[Path], metrics: Optional[dict] = None, status: str = "FINISHED") -> None:
        from mlflow.entities import Metric

        if metrics:
            self.c.log_batch(self.run_id, metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()
                                                   if _finite(v)])
        for a in artifacts:
            if Path(a).is_file():
                self.c.log_artifact(self.run_id, str(a))
        self.c.set_terminated(self.run_id, status)


def track_training(cfg, summary: dict) -> Optional[str]:
    """Log a finished plain training run (``jobs/train.py``) when ``cfg.tracking.enabled``. An
    object-store output is read from the store (its learning curve and summary, fetched into a
    temporary directory); the tracking store is then ``tracking.uri`` (``check_tracking_target``)."""
    if not cfg.tracking.enabled:
        return None
    cfg = cfg.model_copy(update={"model": summary.get("model", cfg.model)})   # chosen by the shards when not given
    from ..fs import location, read_bytes
    from .results import run_metrics

    loc = location(cfg.output, output=True)
    with tempfile.TemporaryDirectory(prefix="pipeline-track-") as tmp:
        out = Path(loc.path) if loc.is_local else Path(tmp) / loc.name
        if not loc.is_local:
            out.mkdir()
            for f in ("metrics.jsonl", "summary.json"):
                (out / f).write_bytes(read_bytes(loc.child(f)))
        uri = store_uri(cfg.tracking.uri, out.parent / "mlruns")
        c = client(uri)
        exp = experiment_id(c, cfg.tracking.experiment or "train")
        rid = log_run(c, exp, loc.name, train_params(cfg), run_metrics(out), out, tags={"pipeline.output": str(loc)})
    log.info("MLflow: run %s in experiment %s at %s", rid, cfg.tracking.experiment or "train", redact(uri))
    summary["mlflow_run_id"] = rid
    return rid


def train_and_track(cfg, spark=None) -> dict:
    """``pipeline.train.launch.train`` followed by :func:`track_training` (the driver side)."""
    from ..train.launch import train

    check_tracking_target(cfg)
    summary = train(cfg, spark)
    track_training(cfg, summary)
    return summary


def check_tracking_target(cfg) -> None:
    """MLflow's default store is a local file store next to the output: an object-store output
    needs ``tracking.uri`` (a tracking server, ``sqlite:///...``); checked before training."""
    from ..errors import ConfigError
    from ..fs import location

    if cfg.tracking.enabled and not cfg.tracking.uri and not location(cfg.output, output=True).is_local:
        raise ConfigError(f"tracking.enabled with output {cfg.output}: MLflow's default file store is local; "
                          "set tracking.uri (a tracking server or sqlite:///path) for an object-store output")
