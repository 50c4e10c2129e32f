"""Learning curves: accuracy against epochs and against wall time, one line per run, to PNG.

Input: training output directories (or their ``metrics.jsonl``), local or on an object store
(``s3://``). Each run is one line, labelled with the directory name. Points are the evaluation
records of ``split`` (``val`` by default; ``test`` gives the final point only). The PNG goes to a
local path or, with one PUT, to an ``s3://`` key.
"""
from __future__ import annotations

import json
import logging
import posixpath
import tempfile
from pathlib import Path
from typing import Optional

from pydantic import Field

from ..config import StageConfig
from ..errors import BadInputError
from ..committed import resolve
from ..fs import Location, check_writable, exists, location, read_bytes, write_bytes

log = logging.getLogger(__name__)


class ReportConfig(StageConfig):
    """Config of ``jobs/report.py``."""

    runs: list[str] = Field(default_factory=lambda: ["runs/hep/train"],
                            description="training output directories or metrics.jsonl files")
    output: str = Field("runs/report/learning_curves.png", description="PNG file to write")
    split: str = Field("val", description="evaluation split to plot (val | test)")
    labels: Optional[list[str]] = Field(None, description="one label per run (default: directory names)")
    title: str = Field("Learning curves", description="figure title")


def _metrics_file(run: str) -> Location:
    loc = location(run)
    if loc.is_local:
        p = Path(loc.path)
        f = location(p / "metrics.jsonl" if p.is_dir() else p)
        found = Path(f.path).is_file()
    else:
        f = loc if loc.name.endswith(".jsonl") else loc.child("metrics.jsonl")
        found = exists(f)
    if not found:
        raise BadInputError(f"metrics file not found: {f}")
    return f


def load_runs(cfg: ReportConfig) -> list[tuple[str, list[dict]]]:
    if cfg.labels is not None and len(cfg.labels) != len(cfg.runs):
        raise BadInputError(f"labels: {len(cfg.labels)} labels for {len(cfg.runs)} runs")
    out = []
    for i, run in enumerate(cfg.runs):
        f = _metrics_file(run)
        try:
            recs = [r for r in (json.loads(x) for x in read_bytes(resolve(f)).decode().splitlines() if x.strip())
                    if r.get("split") == cfg.split and r.get("accuracy") is not None]
        except ValueError as e:
            raise BadInputError(f"{f}: not JSON lines ({e})") from None
        if not recs:
            raise BadInputError(f"{f}: no {cfg.split!r} evaluation records")
        parent = posixpath.basename(posixpath.dirname(f.path))
        label = cfg.labels[i] if cfg.labels else (parent if f.name == "metrics.jsonl" else Path(f.name).stem)
        out.append((label, recs))
    return out


def plan_report(cfg: ReportConfig) -> dict:
    return {"inputs": [str(_metrics_file(r)) for r in cfg.runs], "outputs": [str(location(cfg.output, output=True))]}


def report(cfg: ReportConfig, spark=None) -> dict:
    """Plot the curves; returns {"output": png path, "runs": n}."""
    from .figures import finish_learning_curves, learning_curve_axes

    out = location(cfg.output, output=True)
    check_writable(out)
    runs = load_runs(cfg)
    fig, ax1, ax2 = learning_curve_axes()
    for label, recs in runs:
        ax1.plot([r["epoch"] for r in recs], [r["accuracy"] for r in recs], marker="o", ms=3, label=label)
        ax2.plot([r["wall_s"] for r in recs], [r["accuracy"] for r in recs], marker="o", ms=3, label=label)
    if out.is_local:
        finish_learning_curves(fig, ax1, ax2, f"{cfg.split} accuracy", cfg.title, Path(out.path))
    else:
        with tempfile.TemporaryDirectory(prefix="report-") as tmp:
            png = finish_learning_curves(fig, ax1, ax2, f"{cfg.split} accuracy", cfg.title, Path(tmp) / out.name)
            write_bytes(out, png.read_bytes())
    log.info("learning curves of %d run(s) -> %s", len(runs), out)
    return {"output": str(out), "runs": len(runs)}
