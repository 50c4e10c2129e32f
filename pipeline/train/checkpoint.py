"""Checkpoints: every K steps and at the end; ``resume`` continues from the newest one.

A checkpoint is one file ``<checkpoint_dir>/step_<NNNNNNNN>.pt`` written by rank 0 (write to
a temporary name, then rename, so a crash never leaves a half-written checkpoint). It holds
EVERY rank's state, gathered with ``allgather_object``, because ranks of local/hierarchical
SGD or SlowMo-without-average differ between averages::

    {"step": s, "epoch": e, "offset": k, "elapsed_s": t, "fingerprint": {...},
     "metrics": [previous metric lines], "ranks": [{"model", "optimizer", "algorithm", "rng"}, ...]}

Resuming rebuilds each rank's model/optimizer/algorithm/RNG state, reopens epoch ``e`` with
the same (worker, epoch) seed and skips its first ``k`` batches, so a deterministic run
resumed from a checkpoint ends with the same parameters as one that was never interrupted.
The fingerprint (the config fields that change the result) must match, else ConfigError.
"""
from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import ConfigError

FINGERPRINT_FIELDS = ("model", "epochs", "batch_size", "optimizer", "lr", "momentum", "nesterov", "weight_decay",
                      "lr_scaling", "warmup_epochs", "algorithm", "policy", "seed", "shuffle_buffer", "max_steps")


def fingerprint(cfg, workers: int) -> dict:
    d = cfg.model_dump(mode="json", include=set(FINGERPRINT_FIELDS))
    d["workers"] = workers
    return d


def rank_state(model, optimizer, algo) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "algorithm": algo.state_dict(),
                "rng": torch.get_rng_state()}, buf)
    return buf.getvalue()


def load_rank_state(blob: bytes, model, optimizer, algo, device) -> None:
    st = torch.load(io.BytesIO(blob), map_location=device, weights_only=False)
    model.load_state_dict(st["model"])
    optimizer.load_state_dict(st["optimizer"])
    algo.load_state_dict(st["algorithm"])
    torch.set_rng_state(st["rng"].cpu())


def save(ckpt_dir: str, step: int, payload: dict[str, Any]) -> Path:
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step_{step:08d}.pt"
    tmp = d / f".{final.name}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, final)
    return final


def latest(ckpt_dir: str) -> Optional[Path]:
    d = Path(ckpt_dir)
    if not d.is_dir():
        return None
    found = sorted(p for p in d.iterdir() if re.fullmatch(r"step_\d{8}\.pt", p.name))
    return found[-1] if found else None


def load(path: Path, expected_fingerprint: dict) -> dict:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    fp = ck.get("fingerprint", {})
    for k, v in expected_fingerprint.items():
        if fp.get(k) != v:
            raise ConfigError(f"cannot resume from {path}: config value {k}={v!r} differs from the "
                              f"checkpoint's {fp.get(k)!r}")
    return ck
