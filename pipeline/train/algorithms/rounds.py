"""Round-based algorithms whose workers take DIFFERENT numbers of local steps per round.

The time-budgeted mode (issue 7): in every round each worker takes as many local steps as
fit in ``round_seconds`` of wall clock, then communicates. A slow worker simply takes fewer
steps, so nobody waits for it longer than one of its steps. SwarmSGD's geometric schedule
(mean H, per worker) has the same property. Such an algorithm follows the *round protocol*:

* ``variable_steps`` -- True: the training loop must be driven by rounds, not by a step
  count shared by all workers (``pipeline.train.round_loop``);
* ``rounds_done`` / ``round_finished`` -- completed rounds, and whether the last ``step()``
  ended one (then every worker is at the same round boundary: evaluation and checkpoints
  happen there);
* ``nominal_steps_per_round`` -- H, used only to convert the run's step budget into rounds;
* ``reset_clock()`` -- restart the round's time budget after a pause (evaluation).

This module holds

* :class:`TimedLocalSGD` (``timed_local_sgd``): local SGD with a time budget per round, then
  one all-reduce average. ``weighting="equal"`` is the plain average; ``"steps"`` weights each
  worker by the steps it took in the round, x = sum_i h_i x_i / sum_i h_i (one fused
  all-reduce of [h_i * x_i, h_i]) -- see README.md (Decentralized training) for the choice.
* :class:`RoundSlowMo`: SlowMo around such a base counts ``tau`` in ROUNDS (every worker
  reaches the outer step's all-reduce at the same round; a step count would differ per
  worker). ``slowmo``'s builder picks it when the base has ``variable_steps``.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from . import BuildContext, Spec
from .base import Algorithm
from .decentral import LocalSteps, ParamsOnly, flatten, reset_momentum_if_asked, unflatten_into
from .slowmo import SlowMo


class TimedLocalSGDParams(BaseModel):
    """``algorithm.params`` of ``timed_local_sgd``."""

    model_config = ConfigDict(extra="forbid")
    round_seconds: float = Field(..., gt=0, description="wall-clock budget of each round of local steps")
    nominal_steps: int = Field(4, ge=1, description="expected steps per round (converts the step budget to rounds)")
    weighting: Literal["equal", "steps"] = Field("equal", description="equal average | weighted by steps taken")


class TimedLocalSGD(Algorithm):
    name = "timed_local_sgd"
    variable_steps = True

    def __init__(self, params, optimizer, comm, averager=None, *, round_seconds: float,
                 nominal_steps: int = 4, weighting: str = "equal") -> None:
        super().__init__(params, optimizer, comm)
        if weighting not in ("equal", "steps"):
            raise ValueError(f"weighting {weighting!r}: expected equal|steps")
        self.averager = averager if averager is not None else ParamsOnly(self.params)
        self.weighting = weighting
        self.local = LocalSteps("time", nominal_steps, round_seconds, rank=comm.rank)
        self.nominal_steps_per_round = int(nominal_steps)
        self.rounds_done = 0
        self.steps_in_round = 0
        self.round_finished = False
        self.round_steps: list[int] = []  # this worker's local steps in each round

    def after_step(self) -> None:
        self.steps_in_round += 1
        self.round_finished = False
        if self.local.due(self.steps_in_round):
            self.communicate()

    def communicate(self) -> None:
        if self.weighting == "equal":
            self._average_equal()
        else:
            self._average_weighted()
        self.round_steps.append(self.steps_in_round)
        self.rounds_done += 1
        self.steps_in_round = 0
        self.round_finished = True
        self.local.start_round(self.rounds_done)

    def _average_equal(self) -> None:
        if hasattr(self.averager, "average_"):
            self.averager.average_()
        else:
            self.comm.allreduce_mean_(self.averager.tensors())

    def _average_weighted(self) -> None:
        tensors = self.averager.tensors()
        x = flatten(tensors)
        h = float(self.steps_in_round)
        buf = torch.cat([x * h, torch.tensor([h], dtype=x.dtype, device=x.device)])
        self.comm.allreduce_mean_([buf])
        unflatten_into(buf[:-1] / buf[-1], tensors)
        reset_momentum_if_asked(self.averager)

    def reset_clock(self) -> None:
        self.local.reset_clock()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rounds_done": self.rounds_done, "steps_in_round": self.steps_in_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds_done = int(state.get("rounds_done", 0))
        self.steps_in_round = int(state.get("steps_in_round", 0))


def build_timed(params: TimedLocalSGDParams, ctx: BuildContext) -> TimedLocalSGD:
    return TimedLocalSGD(ctx.model.parameters(), ctx.optimizer, ctx.comm, ctx.policy,
                         round_seconds=params.round_seconds, nominal_steps=params.nominal_steps,
                         weighting=params.weighting)


class RoundSlowMo(SlowMo):
    """SlowMo whose outer step comes every ``tau`` ROUNDS of a variable-steps base."""

    variable_steps = True

    def __init__(self, base: Algorithm, averager, tau: int, beta: float, alpha: float, average: bool = True):
        if not getattr(base, "variable_steps", False):
            raise ValueError(f"RoundSlowMo needs a base with variable_steps, got {base.name}")
        super().__init__(base, averager, tau, beta, alpha, average)

    @property
    def rounds_done(self) -> int:
        return self.base.rounds_done

    @property
    def round_finished(self) -> bool:
        return self.base.round_finished

    @property
    def nominal_steps_per_round(self) -> int:
        return self.base.nominal_steps_per_round

    def reset_clock(self) -> None:
        self.base.reset_clock()

    def step(self) -> None:
        self.base.step()
        self.step_count += 1
        if self.base.round_finished and self.base.rounds_done % self.tau == 0:
            self.outer_step()

    def in_sync(self) -> bool:
        return bool(self.average and self.base.round_finished and self.base.rounds_done % self.tau == 0)


def slowmo_for(base: Algorithm, averager, tau: int, beta: float, alpha: float, average: bool) -> SlowMo:
    """SlowMo (tau in steps) for a fixed-steps base, RoundSlowMo (tau in rounds) for a variable one."""
    cls = RoundSlowMo if getattr(base, "variable_steps", False) else SlowMo
    return cls(base, averager, tau, beta, alpha, average)


SPECS = {"timed_local_sgd": Spec(TimedLocalSGDParams, build_timed)}
