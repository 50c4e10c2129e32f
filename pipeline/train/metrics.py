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
record cover the steps since the previous record; the final ``test`` record's cover the run. Under
the simulated clock (launcher ``inprocess``) a record also carries ``virtual_s``, the run's virtual
time when it was taken (time to a target: ``pipeline.studies.whatif``).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Optional

import numpy as np


def per_class_auc(probs: np.ndarray, labels: np.ndarray,
                  classes: Optional[Iterable[int]] = None) -> dict[str, Optional[float]]:
    """One-vs-rest ROC AUC per class (None where a class has no positives or no negatives, or where
    its scores are not all finite: a diverged model's), of ``classes`` only when given (the ranks
    of a run share the classes: :func:`summarize`)."""
    from sklearn.metrics import roc_auc_score

    out: dict[str, Optional[float]] = {}
    for c in (range(probs.shape[1]) if classes is None else classes):
        y = labels == c
        ok = 0 < y.sum() < len(y) and bool(np.isfinite(probs[:, c]).all())
        out[str(c)] = float(roc_auc_score(y, probs[:, c])) if ok else None
    return out


def summarize(probs: np.ndarray, labels: np.ndarray, loss_sum: float, comm=None) -> dict:
    """Loss, accuracy, per-class AUC and count of a whole split's predictions. With ``comm`` (every
    rank holding the same gathered predictions) each rank computes the AUC of every ``world``-th
    class only and the ranks exchange them: the same values, computed once instead of once per rank
    (sklearn's AUC of every class on every rank was a quarter of a 100-step in-process run)."""
    n = len(labels)
    if n == 0:
        return {"loss": math.nan, "accuracy": math.nan, "auc": {}, "n": 0}
    k = probs.shape[1]
    if comm is None or comm.world_size == 1:
        auc = per_class_auc(probs, labels)
    else:
        mine = per_class_auc(probs, labels, range(comm.rank, k, comm.world_size))
        merged = {c: a for part in comm.allgather_object(mine) for c, a in part.items()}
        auc = {str(c): merged[str(c)] for c in range(k)}
    return {"loss": loss_sum / n, "accuracy": float((probs.argmax(1) == labels).mean()), "auc": auc, "n": int(n)}


def wire_bytes_written() -> Optional[int]:
    """Bytes written by this process through write/send system calls (Linux ``wchar``), else None."""
    import psutil

    try:
        return int(psutil.Process().io_counters().write_chars)
    except (AttributeError, NotImplementedError, psutil.Error, OSError):
        return None


class MetricsWriter:
    """Writes ``metrics.jsonl`` (and optional TensorBoard scalars) under ``out_dir``, a local or
    shared directory or an ``s3://`` prefix, from the rank that owns it (rank 0), wherever it runs.

    A local file gets one appended line per record. An object has no appends: the whole file is
    written again after each record (one PUT of a few kB), so the store always holds every record
    so far. TensorBoard writes into ``<out_dir>/tb`` (an object store: a local scratch directory of
    this rank, copied under the prefix at :meth:`close`)."""

    def __init__(self, out_dir: str, history: list[dict] | None = None, tensorboard: bool = False):
        from ..fs import location

        out = location(out_dir, output=True)
        self.loc = out.child("metrics.jsonl")
        self.path = Path(self.loc.path) if out.is_local else None
        self.history: list[dict] = list(history or [])
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:
                for rec in self.history:
                    f.write(json.dumps(rec) + "\n")
        else:
            self._put()
        self.tb = self._tb_dir = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSON lines only
                import logging

                logging.getLogger(__name__).warning("tensorboard=true but the tensorboard package is not "
                                                    "installed; writing JSON lines only")
            else:
                import tempfile

                self._tb_dir = None if out.is_local else (tempfile.mkdtemp(prefix="pipeline-tb-"), out.child("tb"))
                self.tb = SummaryWriter(os.path.join(out.path, "tb") if out.is_local else self._tb_dir[0])

    def _put(self) -> None:
        from ..fs import write_bytes

        write_bytes(self.loc, "".join(json.dumps(rec) + "\n" for rec in self.history).encode())

    def write(self, rec: dict) -> None:
        self.history.append(rec)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        else:
            self._put()
        if self.tb is not None:
            for k in ("loss", "accuracy", "samples_per_s", "comm_fraction"):
                v = rec.get(k)
                if isinstance(v, (int, float)) and not math.isnan(v):
                    self.tb.add_scalar(f"{rec.get('split', 'train')}/{k}", v, rec.get("step", 0))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self._tb_dir is not None:
            import shutil

            from ..fs import write_bytes

            local, dest = self._tb_dir
            for f in sorted(p for p in Path(local).rglob("*") if p.is_file()):
                write_bytes(dest.child(f.relative_to(local).as_posix()), f.read_bytes())
            shutil.rmtree(local, ignore_errors=True)
            self._tb_dir = None


def read_metrics(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
