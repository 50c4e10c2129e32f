"""Learning-rate schedule and batch rules: what the rate is at each step, and how big a worker's batch is.

* **Scaling of the base rate** (``lr_scaling``): ``linear`` multiplies ``lr`` by M (Goyal et al.
  2017: the global batch M*b gets M times the single-worker rate), ``none`` keeps it,
  ``household`` multiplies it by ``L_W H / (H + L_W - 1)``, the growth of the local batch that
  Eq. A.3 of Håland & Birkeland 2020 gives households (E3.2.3).
* **Gradual warmup** over ``warmup_steps``: the rate rises linearly from ``lr`` to the scaled
  target (E3.2.3: "from 0.1 to the target scaled learning rate"). With a warmup optimizer
  (``warmup_optimizer: sgd``, Wongpanich et al. 2020, Figure 3) the warmup stage is plain
  gradient descent whose rate rises linearly to ``warmup_lr``; the configured optimizer takes
  over at the scaled ``lr`` when the warmup ends.
* **Step decay** (``lr_decay_at``): the rate is multiplied by ``lr_decay_factor`` at each given
  fraction of the run's steps (He et al. 2016 and E1: divided by 10 at 50% and 75%).
* **Batch rules** (``batch_rule``): ``local`` - ``batch_size`` is a worker's batch b;
  ``global`` - it is the global batch B and each of the M workers takes B / M (E1: fixed
  global batch); ``household`` - it is the effective batch B_e of Eq. A.3 and a worker takes
  ``B_e L_W H / (M (H + L_W - 1))``, rounded to the nearest integer (E3.2.2).

Pure functions of numbers: the driver resolves them into the training plan once
(``launch.make_plan``), every worker reads the same values.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from ..errors import ConfigError


def household_lr_factor(households: int, world_period: int) -> float:
    """``L_W H / (H + L_W - 1)``: the local-batch growth of Eq. A.3 against B_e / M (E3.2.3)."""
    h, lw = int(households), int(world_period)
    return lw * h / (h + lw - 1)


def household_local_batch(effective: int, workers: int, households: int, world_period: int) -> int:
    """Eq. A.3: ``B_l = B_e L_W H / (M (H + L_W - 1))``, rounded to the nearest integer (at least 1)."""
    m, h, lw = int(workers), int(households), int(world_period)
    return max(1, int(math.floor(effective * lw * h / (m * (h + lw - 1)) + 0.5)))


def local_batch(rule: str, batch_size: int, workers: int, households: Optional[int] = None,
                world_period: Optional[int] = None) -> int:
    """A worker's batch under ``rule`` (``local`` | ``global`` | ``household``); ConfigError on a
    global batch that M does not divide or a household rule without households."""
    if rule == "local":
        return int(batch_size)
    if rule == "global":
        if batch_size % workers:
            raise ConfigError(f"invalid config value batch_size={batch_size}: batch_rule=global needs a global "
                              f"batch that the {workers} workers divide")
        return batch_size // workers
    if rule == "household":
        if not households or not world_period:
            raise ConfigError("invalid config value batch_rule='household': needs households (a households or "
                              "neighbourhoods shard layout) and the hierarchical algorithm's world period")
        return household_local_batch(batch_size, workers, households, world_period)
    raise ConfigError(f"invalid config value batch_rule={rule!r}: expected local, global or household")


def lr_factor(scaling: str, workers: int, households: Optional[int] = None,
              world_period: Optional[int] = None) -> float:
    """The factor the base rate is scaled by after the warmup."""
    if scaling == "linear":
        return float(workers)
    if scaling == "none":
        return 1.0
    if scaling == "household":
        if not households or not world_period:
            raise ConfigError("invalid config value lr_scaling='household': needs households (a households or "
                              "neighbourhoods shard layout) and the hierarchical algorithm's world period")
        return household_lr_factor(households, world_period)
    raise ConfigError(f"invalid config value lr_scaling={scaling!r}: expected linear, none or household")


def decay_steps(fractions: Sequence[float], total_steps: int) -> list[int]:
    """The steps at which step decay applies: each fraction of ``total_steps``, rounded."""
    return [int(round(f * total_steps)) for f in fractions]


def lr_at(step: int, base_lr: float, factor: float, warmup_steps: int, decay_at: Sequence[int] = (),
          decay_factor: float = 0.1, warmup_lr: Optional[float] = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    ``warmup_lr`` None: linear from ``base_lr`` to ``base_lr * factor`` over ``warmup_steps``;
    else (a separate warmup optimizer) linear from ``warmup_lr / warmup_steps`` to ``warmup_lr``.
    After the warmup: ``base_lr * factor``, times ``decay_factor`` for each step of ``decay_at``
    already reached."""
    target = base_lr * factor
    if warmup_steps > 0 and step < warmup_steps:
        if warmup_lr is not None:
            return warmup_lr * (step + 1) / warmup_steps
        return base_lr + (target - base_lr) * (step + 1) / warmup_steps
    return target * decay_factor ** sum(1 for s in decay_at if step >= s)


def set_lr(optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def household_terms(layout, algorithm_name: str, params: dict) -> tuple[Optional[int], Optional[int]]:
    """(H, L_W) of a run: the households of the shard layout and the period at which the whole
    world averages (hierarchical: the neighbourhood period when the layout has one neighbourhood,
    which is then the world, else the world period). (None, None) for other runs."""
    h = getattr(layout, "households", None)
    if algorithm_name != "hierarchical" or not h:
        return None, None
    one_hood = (getattr(layout, "neighbourhoods", None) or 1) == 1
    key = "neighbourhood_period" if one_hood else "world_period"
    defaults = {"neighbourhood_period": 4, "world_period": 8}  # the hierarchical algorithm's defaults
    return int(h), int(params.get(key, defaults[key]))


def plan_terms(cfg, layout, workers: int, total_steps_of) -> dict:
    """The plan's batch and rate terms of a TrainConfig ``cfg`` on ``layout`` (a manifest's
    LayoutSpec): ``batch_size`` (a worker's batch), ``lr_factor``; ``total_steps_of(b)`` gives the
    run's steps for a worker batch b, from which ``decay_steps`` are placed."""
    h, lw = household_terms(layout, cfg.algorithm.name, cfg.algorithm.params)
    b = local_batch(cfg.batch_rule, cfg.batch_size, workers, h, lw)
    return {"batch_size": b, "lr_factor": lr_factor(cfg.lr_scaling, workers, h, lw),
            "decay_steps": decay_steps(cfg.lr_decay_at, total_steps_of(b))}
