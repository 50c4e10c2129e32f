"""The figures of docs/results.md: validation accuracy against steps, one line per table cell (the mean
over its seeds, a band of ± one standard deviation), the source's reported value marked at the last
step. The data comes from the run records (``pipeline.studies.tables.figure_data``); this module only
draws it.

A figure is written deterministically (no timestamp or software tag in the PNG) and carries the
SHA-256 of the data it shows in its ``Description`` text chunk, so a check can tell a stale figure
from the records alone (:func:`digest`, :func:`stored_digest`) without depending on the renderer.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

TAG = "results-figure sha256 "


def digest(data: dict) -> str:
    """The SHA-256 of a figure's data (floats rounded to 6 digits)."""
    def rounded(x):
        if isinstance(x, float):
            return round(x, 6)
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rounded(v) for v in x]
        return x

    return hashlib.sha256(json.dumps(rounded(data), sort_keys=True).encode()).hexdigest()


def stored_digest(path: Path) -> Optional[str]:
    """The data digest a committed figure carries, or None (no file, or not one of ours)."""
    path = Path(path)
    if not path.is_file():
        return None
    from PIL import Image

    with Image.open(path) as im:
        text = getattr(im, "text", {}) or {}
    desc = text.get("Description", "")
    return desc[len(TAG):] if desc.startswith(TAG) else None


def save_tagged(fig, path: Path, data: dict) -> None:
    """Write ``fig`` to ``path`` as a PNG with no timestamp or software tag, carrying the digest of
    ``data`` (:data:`TAG`), whole (``fs.write_bytes``); close the figure."""
    import io

    from ..fs import location, write_bytes
    from .figures import pyplot

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, metadata={"Software": None, "Description": TAG + digest(data)})
    pyplot().close(fig)
    write_bytes(location(Path(path)), buf.getvalue())


def draw(data: dict, path: Path) -> Path:
    """Draw ``data`` (``{"title", "ylabel", "panels": [{"title", "lines": [{"label", "steps", "mean",
    "std", "n", "source"}]}]}``) to ``path`` (PNG), tagged with its digest."""
    import matplotlib

    from .figures import pyplot

    plt = pyplot()
    with matplotlib.rc_context({"font.family": "DejaVu Sans", "svg.hashsalt": "results", "path.simplify": True}):
        panels = data["panels"]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 0.6, 3.6), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            empty = []
            for i, line in enumerate(panel["lines"]):
                color = f"C{i % 10}"
                if not line["steps"]:   # no run to draw (every run at chance, or none recorded): said in words
                    empty.append(f"{line['label']}: no curve")
                    continue
                lo = [m - s for m, s in zip(line["mean"], line["std"])]
                hi = [m + s for m, s in zip(line["mean"], line["std"])]
                ax.plot(line["steps"], line["mean"], color=color, lw=1.4, label=f"{line['label']} (n = {line['n']})")
                ax.fill_between(line["steps"], lo, hi, color=color, alpha=0.18, lw=0)
                if line.get("source") is not None:
                    ax.plot([line["steps"][-1]], [line["source"]], marker="*", ms=11, color=color, mec="black",
                            mew=0.6, ls="none")
            ax.set_title(panel["title"], fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel(data["ylabel"])
            ax.grid(alpha=0.3)
            lows = [m - s for ln in panel["lines"] for m, s in zip(ln["mean"][-3:], ln["std"][-3:])]
            tops = [m + s for ln in panel["lines"] for m, s in zip(ln["mean"], ln["std"])] + \
                [ln["source"] for ln in panel["lines"] if ln.get("source") is not None]
            if lows and tops:  # the end of the runs, where the verdicts are made, fills the panel
                ax.set_ylim(max(0.0, min(lows) - 8.0), min(100.0, max(tops) + 1.0))
            if len(empty) < len(panel["lines"]):
                ax.legend(fontsize=7, loc="lower right")
            if empty:
                ax.text(0.5, 0.5 if len(empty) == len(panel["lines"]) else 0.08, "\n".join(empty),
                        transform=ax.transAxes, ha="center", va="center", fontsize=8)
        marked = any(ln.get("source") is not None for p in panels for ln in p["lines"])
        fig.suptitle(data["title"] + ("  (stars: the source's values)" if marked else ""), fontsize=10)
        fig.tight_layout()
        save_tagged(fig, path, data)
    return Path(path)
