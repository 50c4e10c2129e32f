"""A study's outputs from its runs' rows: results.parquet, stats.parquet, report.md and the plots
(the study layout: :mod:`.runner`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..fs import location, write_bytes
from .grid import StudyPlan
from .spec import METRICS


def results_frame(rows: list[dict]):
    """results.parquet as a DataFrame; factor values of mixed types become strings."""
    import pandas as pd

    df = pd.DataFrame(rows)
    for col in df.columns:
        types = {type(v) for v in df[col] if v is not None}
        if len(types) > 1 and not types <= {int, float}:
            df[col] = df[col].map(lambda v: v if isinstance(v, str) else str(v))
        elif types and not types <= {int, float, bool, str}:
            df[col] = df[col].map(str)
    return df


def _write_parquet(df, path: Path) -> None:
    import io

    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    write_bytes(location(path), buf.getvalue())


def write_outputs(plan: StudyPlan, rows: list[dict], out: Path, records: Optional[dict] = None) -> list[Path]:
    """results.parquet, stats.parquet, report.md and the plots; returns their paths. ``records``:
    (cell name, seed) -> the run record of a run taken from the records (its curve)."""
    from ..report.study import markdown_report
    from .stats import cell_stats

    spec = plan.spec
    df = results_frame(rows)
    _write_parquet(df, out / "results.parquet")
    stats = cell_stats(df, spec.metrics, {c.name: plan.baselines[c.key].name for c in plan.cells})
    _write_parquet(stats, out / "stats.parquet")
    plots = write_plots(plan, df, out, records or {}) if spec.plots else []
    cells = [{"cell": c.name, **{k: v for k, v in c.factors.items()}, "runs": len(plan.seeds),
              "baseline": plan.baselines[c.key].name} for c in plan.cells]
    have = set(zip(df["cell"], df["seed"]))
    missing = [f"{c.name} seed {s}" for c, s in plan.runs if (c.name, s) not in have]
    intro = _intro(plan) + ([f"- runs missing (failed, see their error.txt): {'; '.join(missing)}"] if missing else [])
    md = markdown_report(f"Study {spec.name}", intro, cells, stats, {m: METRICS[m] for m in spec.metrics},
                         [str(p.relative_to(out)) for p in plots])
    write_bytes(location(out / "report.md"), md.encode())
    return [out / "results.parquet", out / "stats.parquet", out / "report.md", *plots]


def _intro(plan: StudyPlan) -> list[str]:
    spec = plan.spec
    lines = [spec.description, ""] if spec.description else []
    if spec.question:
        lines += [f"Question: {spec.question}", ""]
    lines += [f"- workflow: {spec.workflow}, base: {spec.base or '(defaults)'}, "
              f"fixed: {json.dumps(spec.fixed, default=str)}",
              f"- seeds: {plan.seeds} (into {', '.join(spec.seed_keys)})",
              f"- baseline cell{'s' if len(plan.baseline_cells) > 1 else ''}: "
              f"{'; '.join(c.name for c in plan.baseline_cells)}",
              "- statistics over seeds: mean ± sample std, 95% CI of the mean (Student's t), two-sided "
              "Welch's t-test p-value against the baseline cell"]
    if spec.target_accuracy is not None:
        lines.append(f"- target validation accuracy: {spec.target_accuracy}")
    return lines


def write_plots(plan: StudyPlan, df, out: Path, records: dict) -> list[Path]:
    from ..report.study import plot_learning_curves, plot_speedup
    from .results import load_curve

    curves: dict[str, list] = {c.name: [] for c in plan.cells}
    for cell, key, seed in zip(df["cell"], df["cell_key"], df["seed"]):
        rec = records.get((cell, int(seed)))
        curves[cell].append(rec["curve"] if rec else load_curve(out / "runs" / key / f"seed_{seed}" / "train"))
    paths = [plot_learning_curves(curves, out / "plots" / "learning_curves.png", title=f"Study {plan.spec.name}")]
    if "workers" in plan.spec.factors.grid and len(plan.spec.factors.grid["workers"]) > 1:
        paths.append(plot_speedup(speedup_groups(plan, df), out / "plots" / "speedup_vs_workers.png",
                                  title=f"Study {plan.spec.name}: speed-up against workers"))
    return paths


def speedup_groups(plan: StudyPlan, df) -> dict:
    """setting (the cell's factors other than workers) -> workers -> mean samples/s and time to target."""
    groups: dict[str, dict[int, dict]] = {}
    for c in plan.cells:
        rest = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in c.factors.items() if k != "workers") or "all"
        sub = df[df["cell"] == c.name]
        groups.setdefault(rest, {})[int(c.factors["workers"])] = {
            "samples_per_s": float(sub["samples_per_s"].mean()),
            "time_to_target_s": float(sub["time_to_target_s"].mean())}
    return groups
