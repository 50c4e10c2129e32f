"""The figure of the steps-to-result studies in docs/results.md: steps to a target validation error
against the global batch on log-log axes, normalised by the steps at the smallest batch (as the plots
of Shallue et al. that Bonet, Wang & Tang show), one line per workload, family and target, with the
line of perfect scaling. The data comes from the run records
(``pipeline.studies.steps_page.figure_data``); this module only draws it. Like the other figures
of the page it carries the SHA-256 of its data (``results_figures.digest``) and no timestamp."""
from __future__ import annotations

from pathlib import Path

from .results_figures import save_tagged


def draw(data: dict, path: Path) -> Path:
    """Draw ``data`` (``{"title", "lines": [{"label", "batches", "normalised"}]}``) to ``path`` (PNG)."""
    import matplotlib

    from .figures import pyplot

    plt = pyplot()
    with matplotlib.rc_context({"font.family": "DejaVu Sans", "path.simplify": True}):
        fig, ax = plt.subplots(figsize=(6.0, 4.2))
        xs = sorted({b for ln in data["lines"] for b in ln["batches"]})
        if xs:
            ax.plot(xs, [xs[0] / b for b in xs], color="grey", ls=":", lw=1, label="perfect scaling")
        for i, ln in enumerate(data["lines"]):
            if ln["batches"]:
                ax.plot(ln["batches"], ln["normalised"], marker="o", ms=4, lw=1.3, color=f"C{i % 10}",
                        ls="-" if "momentum" in ln["label"] else "--", label=ln["label"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("global batch")
        ax.set_ylabel("steps / steps at the smallest batch")
        ax.set_title(data["title"], fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower left")
        fig.tight_layout()
        save_tagged(fig, path, data)
    return Path(path)
