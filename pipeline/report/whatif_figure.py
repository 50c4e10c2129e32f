"""The what-if plot (:mod:`pipeline.studies.whatif`): time to the target and its cost against the
worker count, one line per algorithm; a cell that did not reach the target within its budget has no
point (the table says so)."""
from __future__ import annotations

from pathlib import Path

from .figures import pyplot, savefig


def draw(table: dict, path: Path) -> Path:
    """Two panels from ``table`` (table.json's content): virtual time to target, and cost, against M."""
    fig, (ax_t, ax_c) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in table["rows"]))
    for a in algorithms:
        pts = sorted((r["workers"], r["time_to_target_s"], r["cost"]) for r in table["rows"]
                     if r["algorithm"] == a and r["reached"])
        if pts:
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=a)
            ax_c.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=a)
    workers = sorted({r["workers"] for r in table["rows"]})
    for ax, ylabel in ((ax_t, "virtual time to target (s)"), (ax_c, f"cost ({table['currency']})")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(m) for m in workers])
        ax.set_xlabel("workers M")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"time to val accuracy {table['target']:g} on {table['cluster']} "
                 f"({table['cluster_fields'].get('ranks_per_node', 1)} rank(s) per node)")
    fig.tight_layout()
    savefig(fig, path)
    return path
