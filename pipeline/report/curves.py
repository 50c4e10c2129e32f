"""Learning curves: accuracy against epochs and against wall time, one line per run, to PNG.

Input: training output directories (or their ``metrics.jsonl``). Each run is one line,
labelled with the directory name (or ``summary.json``'s algorithm/launcher). Points are the
evaluation records of ``split`` (``val`` by default; ``test`` gives the final point only).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from pydantic import Field

from ..config import StageConfig
from ..errors import BadInputError
from ..outputs import local_path

log = logging.getLogger(__name__)


class ReportConfig(StageConfig):
    """Config of ``jobs/report.py``."""

    runs: list[str] = Field(default_factory=lambda: ["runs/images/train"],
                            description="training output directories or metrics.jsonl files")
    output: str = Field("runs/report/learning_curves.png", description="PNG file to write")
    split: str = Field("val", description="evaluation split to plot (val | test)")
    labels: Optional[list[str]] = Field(None, description="one label per run (default: directory names)")
    title: str = Field("Learning curves", description="figure title")


def _metrics_file(run: str) -> Path:
    p = local_path(run)
    f = p / "metrics.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise BadInputError(f"metrics file not found: {f}")
    return f


def load_runs(cfg: ReportConfig) -> list[tuple[str, list[dict]]]:
    from ..train.metrics import read_metrics

    if cfg.labels is not None and len(cfg.labels) != len(cfg.runs):
        raise BadInputError(f"labels: {len(cfg.labels)} labels for {len(cfg.runs)} runs")
    out = []
    for i, run in enumerate(cfg.runs):
        f = _metrics_file(run)
        try:
            recs = [r for r in read_metrics(str(f)) if r.get("split") == cfg.split and r.get("accuracy") is not None]
        except ValueError as e:
            raise BadInputError(f"{f}: not JSON lines ({e})") from None
        if not recs:
            raise BadInputError(f"{f}: no {cfg.split!r} evaluation records")
        label = cfg.labels[i] if cfg.labels else (f.parent.name if f.name == "metrics.jsonl" else f.stem)
        out.append((label, recs))
    return out


def plan_report(cfg: ReportConfig) -> dict:
    return {"inputs": [str(_metrics_file(r)) for r in cfg.runs], "outputs": [str(local_path(cfg.output))]}


def report(cfg: ReportConfig, spark=None) -> dict:
    """Plot the curves; returns {"output": png path, "runs": n}."""
    from .figures import finish_learning_curves, learning_curve_axes

    runs = load_runs(cfg)
    fig, ax1, ax2 = learning_curve_axes()
    for label, recs in runs:
        ax1.plot([r["epoch"] for r in recs], [r["accuracy"] for r in recs], marker="o", ms=3, label=label)
        ax2.plot([r["wall_s"] for r in recs], [r["accuracy"] for r in recs], marker="o", ms=3, label=label)
    out = local_path(cfg.output)
    finish_learning_curves(fig, ax1, ax2, f"{cfg.split} accuracy", cfg.title, out)
    log.info("learning curves of %d run(s) -> %s", len(runs), out)
    return {"output": str(out), "runs": len(runs)}
