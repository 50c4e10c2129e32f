"""Time-budgeted local SGD: the round-driven algorithm whose workers take DIFFERENT step counts.

In every round each worker takes as many local steps as fit in ``round_seconds`` of wall
clock, then communicates. A slow worker simply takes fewer steps, so nobody waits for it
longer than one of its steps (SwarmSGD's time and geometric schedules have the same
property). It follows the round protocol of :class:`~.base.RoundAlgorithm`, and the run is
driven by rounds (``pipeline.train.drivers.run_rounds``).

:class:`TimedLocalSGD` (``timed_local_sgd``): local SGD with a time budget per round, then one
all-reduce average. ``weighting="equal"`` is the plain average; ``"steps"`` weights each worker
by the steps it took in the round, x = sum_i h_i x_i / sum_i h_i (one fused all-reduce of
[h_i * x_i, h_i]) -- see docs/decentralized.md for the choice. SlowMo around it counts ``tau``
in rounds (``slowmo.RoundSlowMo``).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..comm.fusion import flatten, unflatten_
from . import BuildContext, Spec
from .base import RoundAlgorithm
from .decentral import LocalSteps, ParamsOnly, reset_momentum_if_asked


class TimedLocalSGDParams(BaseModel):
    """``algorithm.params`` of ``timed_local_sgd``."""

    model_config = ConfigDict(extra="forbid")
    round_seconds: float = Field(..., gt=0, description="wall-clock budget of each round of local steps")
    nominal_steps: int = Field(4, ge=1, description="expected steps per round (converts the step budget to rounds)")
    weighting: Literal["equal", "steps"] = Field("equal", description="equal average | weighted by steps taken")

    def time_round_steps(self) -> int:
        """Its rounds are time budgets meant to hold nominal_steps steps (``algorithms.time_round_steps``)."""
        return self.nominal_steps


class TimedLocalSGD(RoundAlgorithm):
    name = "timed_local_sgd"
    variable_steps = True

    def __init__(self, params, optimizer, comm, averager=None, *, round_seconds: float,
                 nominal_steps: int = 4, weighting: str = "equal") -> None:
        super().__init__(params, optimizer, comm)
        if weighting not in ("equal", "steps"):
            raise ValueError(f"weighting {weighting!r}: expected equal|steps")
        self.averager = averager if averager is not None else ParamsOnly(self.params, comm)
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
        self.averager.average_()

    def _average_weighted(self) -> None:
        tensors = self.averager.tensors()
        x = flatten(tensors)
        h = float(self.steps_in_round)
        buf = torch.cat([x * h, torch.tensor([h], dtype=x.dtype, device=x.device)])
        self.comm.allreduce_mean_([buf])
        unflatten_(buf[:-1] / buf[-1], tensors)
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


SPECS = {"timed_local_sgd": Spec(TimedLocalSGDParams, build_timed)}
