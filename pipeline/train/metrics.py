"""Evaluation metrics and the metrics sinks (JSON lines, optional TensorBoard).

One JSON object per line in ``<output>/metrics.jsonl``::

    {"kind": "eval", "split": "val", "step": 110, "epoch": 1.0, "wall_s": 12.3,
     "loss": 0.21, "accuracy": 0.94, "auc": {"0": 0.99, ...}, "train_loss": 0.25,
     "samples_per_s": 850.0, "comm_fraction": 0.12, "bytes_sent": 123456,
     "bytes_sent_per_step": 246912.0, "wire_bytes_written": 345678}

``epoch`` counts global epochs (step / ceil(N / B_global)); ``samples_per_s`` is global
(all workers); ``comm_fraction``, ``bytes_sent`` (payload handed to the communicator,
cumulative, this worker) and ``wire_bytes_written`` (bytes this worker process wrote through
system calls, from /proc/self/io: the measured traffic) are rank 0's. Rates of a ``val``
record cover the steps since the previous record; the final ``test`` record's cover the run.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import numpy as np


def per_class_auc(probs: np.ndarray, labels: np.ndarray) -> dict[str, Optional[float]]:
    """One-vs-rest ROC AUC per class (None where a class has no positives or no negatives)."""
    from sklearn.metrics import roc_auc_score

    out: dict[str, Optional[float]] = {}
    for c in range(probs.shape[1]):
        y = labels == c
        out[str(c)] = float(roc_auc_score(y, probs[:, c])) if 0 < y.sum() < len(y) else None
    return out


def summarize(probs: np.ndarray, labels: np.ndarray, loss_sum: float) -> dict:
    n = len(labels)
    if n == 0:
        return {"loss": math.nan, "accuracy": math.nan, "auc": {}, "n": 0}
    return {"loss": loss_sum / n, "accuracy": float((probs.argmax(1) == labels).mean()),
            "auc": per_class_auc(probs, labels), "n": int(n)}


def wire_bytes_written() -> Optional[int]:
    """Bytes written by this process through write/send system calls (Linux ``wchar``), else None."""
    import psutil

    try:
        return int(psutil.Process().io_counters().write_chars)
    except (AttributeError, NotImplementedError, psutil.Error, OSError):
        return None


class MetricsWriter:
    """Appends JSON lines (and optional TensorBoard scalars); used on rank 0 only."""

    def __init__(self, out_dir: str, history: list[dict] | None = None, tensorboard: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.history: list[dict] = list(history or [])
        with open(self.path, "w") as f:
            for rec in self.history:
                f.write(json.dumps(rec) + "\n")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
            except ImportError:  # tensorboard not installed: JSON lines only
                import logging

                logging.getLogger(__name__).warning("tensorboard=true but the tensorboard package is not "
                                                    "installed; writing JSON lines only")
                self.tb = None

    def write(self, rec: dict) -> None:
        self.history.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k in ("loss", "accuracy", "samples_per_s", "comm_fraction"):
                v = rec.get(k)
                if isinstance(v, (int, float)) and not math.isnan(v):
                    self.tb.add_scalar(f"{rec.get('split', 'train')}/{k}", v, rec.get("step", 0))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
