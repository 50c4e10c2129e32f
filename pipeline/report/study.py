"""Tables and plots of a study (rendering only: the numbers come from ``pipeline.studies``).

* :func:`markdown_report`: ``report.md``, per metric a table of mean +- std, 95% CI and the
  Welch p-value against the baseline cell for every cell.
* :func:`plot_learning_curves`: validation accuracy against epochs and against training wall
  time, one line per cell (mean over seeds at each evaluation, band = +- one std).
* :func:`plot_speedup`: speed-up against the number of workers (samples/s, and time to target
  when given) relative to the fewest workers of the same setting, with the ideal line.

Numbers are printed with 4 significant digits (p-values with 3) in a form ``float()`` reads back.
"""
from __future__ import annotations

import math
from pathlib import Path

from .figures import finish_learning_curves, learning_curve_axes, pyplot, savefig


def fmt(x, digits: int = 4) -> str:
    """A number for a table: ``-`` for missing, else ``digits`` significant digits."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, bool):
        return str(x)
    return f"{float(x):.{digits}g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def markdown_report(title: str, intro: list[str], cells: list[dict], stats, metrics: dict[str, str],
                    plots: list[str]) -> str:
    """``cells``: dicts with ``cell`` (name) and its factor values; ``stats``: the DataFrame of
    ``pipeline.studies.stats.cell_stats``; ``metrics``: metric -> description."""
    lines = [f"# {title}", ""] + intro + [""]
    factor_cols = [k for k in cells[0] if k not in ("cell", "runs", "baseline")] if cells else []
    lines += ["## Cells", ""]
    lines += _table(["cell"] + factor_cols + ["runs", "baseline"],
                    [[c["cell"]] + [str(c[k]) for k in factor_cols] + [str(c.get("runs", "")), str(c.get("baseline", ""))]
                     for c in cells])
    for metric, desc in metrics.items():
        sub = stats[stats["metric"] == metric]
        lines += ["", f"## {metric}", "", desc, ""]
        rows = []
        for r in sub.itertuples(index=False):
            ci = "-" if math.isnan(r.ci_low) else f"[{fmt(r.ci_low)}, {fmt(r.ci_high)}]"
            p = "baseline" if r.baseline else fmt(r.p_value, 3)
            n = f"{r.n}" if r.n == r.n_runs else f"{r.n} of {r.n_runs}"
            rows.append([r.cell, n, f"{fmt(r.mean)} ± {fmt(r.std)}", ci, p])
        lines += _table(["cell", "n", "mean ± std", "95% CI", "p (Welch vs baseline)"], rows)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def plot_learning_curves(curves: dict[str, list[list[dict]]], path: Path, split: str = "val",
                         title: str = "") -> Path:
    """``curves``: cell -> one list of evaluation records per seed (``step``, ``epoch``, ``wall_s``, ``accuracy``)."""
    import numpy as np

    fig, ax1, ax2 = learning_curve_axes()
    for cell, runs in curves.items():
        by_step: dict[int, list[dict]] = {}
        for recs in runs:
            for r in recs:
                if r.get("split") == split and r.get("accuracy") is not None:
                    by_step.setdefault(int(r["step"]), []).append(r)
        steps = sorted(by_step)
        if not steps:
            continue
        acc = [np.mean([r["accuracy"] for r in by_step[s]]) for s in steps]
        sd = [np.std([r["accuracy"] for r in by_step[s]]) for s in steps]
        ep = [np.mean([r["epoch"] for r in by_step[s]]) for s in steps]
        wall = [np.mean([r["wall_s"] for r in by_step[s]]) for s in steps]
        for ax, x in ((ax1, ep), (ax2, wall)):
            line, = ax.plot(x, acc, marker="o", ms=3, label=cell)
            ax.fill_between(x, np.subtract(acc, sd), np.add(acc, sd), color=line.get_color(), alpha=0.15)
    return finish_learning_curves(fig, ax1, ax2, f"{split} accuracy (mean over seeds)", title or "Learning curves",
                                  path, legend_size=7)


def plot_speedup(groups: dict[str, dict[int, dict[str, float]]], path: Path, title: str = "") -> Path:
    """``groups``: setting -> workers -> {"samples_per_s": mean, "time_to_target_s": mean (optional)}.
    Speed-up = throughput(M) / throughput(M_min), and time_to_target(M_min) / time_to_target(M)."""
    plt = pyplot()
    has_ttt = any(not math.isnan(v.get("time_to_target_s", math.nan)) for g in groups.values() for v in g.values())
    fig, axes = plt.subplots(1, 2 if has_ttt else 1, figsize=(11 if has_ttt else 6, 4.2), squeeze=False)
    all_m = sorted({m for g in groups.values() for m in g})
    for j, (key, label) in enumerate([("samples_per_s", "throughput speed-up"),
                                      ("time_to_target_s", "time-to-target speed-up")][: 2 if has_ttt else 1]):
        ax = axes[0][j]
        for name, g in groups.items():
            ms = sorted(g)
            ref = g[ms[0]].get(key, math.nan)
            if key == "samples_per_s":
                ys = [g[m].get(key, math.nan) / ref for m in ms]
            else:
                ys = [ref / g[m].get(key, math.nan) for m in ms]
            ax.plot(ms, ys, marker="o", label=name)
        if all_m:
            ax.plot(all_m, [m / all_m[0] for m in all_m], "k--", lw=1, label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_m, [str(m) for m in all_m])
        ax.set_xlabel("workers M")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "Speed-up against workers")
    fig.tight_layout()
    savefig(fig, path)
    return path

