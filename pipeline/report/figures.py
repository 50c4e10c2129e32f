"""Figure plumbing shared by the reports: headless pyplot, the two-panel learning-curve layout
(accuracy against epochs and against training wall time) and an atomic PNG write."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def learning_curve_axes():
    """``(fig, ax_epochs, ax_wall)``: the two panels of a learning-curve figure."""
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    return fig, ax1, ax2


def finish_learning_curves(fig, ax_epochs, ax_wall, ylabel: str, title: str, path: Path,
                           legend_size: int = 8) -> Path:
    """Label both panels, add the legend and the title, and write ``path``."""
    ax_epochs.set_xlabel("epoch")
    ax_wall.set_xlabel("training wall time (s)")
    for ax in (ax_epochs, ax_wall):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_epochs.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    savefig(fig, path)
    return path


def savefig(fig, path: Path) -> None:
    """Write the figure whole (``fs.write_bytes``: a temporary name and a rename); close the figure."""
    import io

    from ..fs import location, write_bytes

    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".") or "png", dpi=110)
    pyplot().close(fig)
    write_bytes(location(path), buf.getvalue())
