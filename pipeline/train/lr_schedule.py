"""Learning-rate schedule: the linear scaling rule and gradual warmup (Goyal et al. 2017).

``target = lr * M`` with ``lr_scaling="linear"`` (M workers, so the global batch M*b gets M
times the single-worker rate), else ``lr``. During the first ``warmup_steps`` the rate rises
linearly from ``lr`` to ``target``; afterwards it stays at ``target``.
"""
from __future__ import annotations


def lr_at(step: int, base_lr: float, workers: int, scaling: str, warmup_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    target = base_lr * (workers if scaling == "linear" else 1)
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    return base_lr + (target - base_lr) * (step + 1) / warmup_steps


def set_lr(optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
