"""One row of ``results.parquet`` per run, read from the training outputs.

Sources (written by ``pipeline.train``): ``summary.json`` (test metrics, steps, per-rank
communication counters) and ``metrics.jsonl`` (one record per evaluation: ``split``, ``step``,
``epoch``, ``wall_s``, ``accuracy``, ``loss``, ``samples_per_s``, ``bytes_sent``,
``wire_bytes_written``, ``comm_fraction``; the last record is the final ``test`` evaluation,
whose rates cover the whole run).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from ..errors import BadInputError
from ..outputs import read_json

NAN = float("nan")


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and v is not None else NAN


def load_curve(train_dir: Path) -> list[dict]:
    """The evaluation records of a finished run (``metrics.jsonl``)."""
    from ..train.metrics import read_metrics

    f = Path(train_dir) / "metrics.jsonl"
    if not f.is_file():
        raise BadInputError(f"metrics file not found: {f}")
    try:
        return read_metrics(str(f))
    except ValueError as e:
        raise BadInputError(f"{f}: not JSON lines ({e})") from None


def val_records(curve: list[dict], split: str = "val") -> list[dict]:
    return [r for r in curve if r.get("split") == split and r.get("accuracy") is not None]


def time_to_target(curve: list[dict], target: Optional[float], split: str = "val",
                   clock: str = "wall_s") -> tuple[float, float]:
    """(seconds on ``clock``: training wall or ``virtual_s``, epochs) at the first ``split`` evaluation with
    accuracy >= target; NaN if never."""
    if target is None:
        return NAN, NAN
    for r in val_records(curve, split):
        if r["accuracy"] >= target:
            return _num(r.get(clock)), _num(r.get("epoch"))
    return NAN, NAN


def clock_metrics(summary: dict, curve: list[dict], target: Optional[float]) -> dict:
    """The virtual-time columns of a run under the simulated clock (``summary["simulated_clock"]``);
    NaN for a run without it."""
    clock = summary.get("simulated_clock") or {}
    vs = _num(clock.get("virtual_s"))
    steps, samples = _num(summary.get("steps")), _num(summary.get("samples_processed"))
    links = clock.get("bytes_per_link") or {}
    return {
        "virtual_s": vs,
        "virtual_s_per_step": vs / steps if steps and not math.isnan(vs) else NAN,
        "virtual_samples_per_s": samples / vs if vs and not math.isnan(vs) else NAN,
        "virtual_time_to_target_s": time_to_target(curve, target, clock="virtual_s")[0] if clock else NAN,
        "comm_share": _num(clock.get("comm_share")),
        "inter_node_bytes": float(sum(v for k, v in links.items() if "->" in k)) if clock else NAN,
    }


def _macro_auc(auc: Any) -> float:
    vals = [v for v in (auc or {}).values() if isinstance(v, (int, float))]
    return float(sum(vals) / len(vals)) if vals else NAN


def run_metrics(train_dir: Path, target: Optional[float] = None) -> dict:
    """The metric columns of one finished run (see ``pipeline.studies.spec.METRICS``)."""
    train_dir = Path(train_dir)
    summary = read_json(train_dir / "summary.json")
    curve = load_curve(train_dir)
    vals = val_records(curve)
    tests = [r for r in curve if r.get("split") == "test"]
    final = tests[-1] if tests else {}
    comm = summary.get("comm") or []
    sps = _num(final.get("samples_per_s"))
    if math.isnan(sps) and summary.get("train_seconds"):
        sps = _num(summary.get("samples_processed")) / float(summary["train_seconds"])
    t_s, t_ep = time_to_target(curve, target)
    out = {
        "test_accuracy": _num(summary.get("test_accuracy")),
        "test_loss": _num(summary.get("test_loss")),
        "test_auc": _macro_auc(summary.get("auc")),
        "val_accuracy": _num(vals[-1]["accuracy"]) if vals else NAN,
        "best_val_accuracy": max((_num(r["accuracy"]) for r in vals), default=NAN),
        "time_to_target_s": t_s,
        "epochs_to_target": t_ep,
        "reached_target": bool(target is not None and not math.isnan(t_s)),
        "train_seconds": _num(summary.get("train_seconds")),
        "seconds": _num(summary.get("seconds")),
        "samples_per_s": sps,
        "bytes_sent": float(sum(_num(c.get("bytes_sent")) + _num(c.get("p2p_bytes_sent", 0)) for c in comm))
        if comm else NAN,
        "bytes_sent_per_step": _num(final.get("bytes_sent_per_step")),
        "wire_bytes": _num(final.get("wire_bytes_written")),
        "comm_fraction": _num(final.get("comm_fraction")),
        "steps": _num(summary.get("steps")),
        "epochs": _num(final.get("epoch")) if final else (_num(vals[-1].get("epoch")) if vals else NAN),
        "n_workers": int(summary.get("workers") or 0),
        "algorithm_name": str(summary.get("algorithm", "")),
    }
    out.update(clock_metrics(summary, curve, target))
    for k, v in sorted((summary.get("auc") or {}).items()):
        out[f"test_auc_{k}"] = _num(v)
    return out
