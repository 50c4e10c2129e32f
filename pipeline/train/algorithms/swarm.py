"""SwarmSGD (Nadiradze et al. 2019): local steps, then averaging with ONE partner.

Every worker runs rounds. In a round it takes H local optimizer steps (``schedule``:
``fixed`` H, ``geometric`` with mean H and a fresh draw per worker and round, or ``time``:
as many as fit in ``round_seconds``), then averages its model with the partner that the
round's random matching of the communication graph gives it::

    partner = graph.matching(seed, round)[rank]          # same on every worker, no messages
    x_partner = comm.exchange([x], partner)              # one flat vector each way
    x = w * x + (1 - w) * x_partner

Matching, graphs and the seeding rule are in :mod:`pipeline.train.topology`; with an odd
worker count one worker sits the round out. On the Horovod backend ``exchange`` is an
``alltoall`` (a global collective, every worker calls it every round); on torch.distributed
only the two partners talk (point to point), so a slow pair delays nobody else.

Averaging weight ``w`` (``weighting``):

* ``equal`` (default): w = 1/2. Both partners end with the same model and the *global mean
  of the parameters is preserved exactly* -- the invariant of SwarmSGD's analysis.
* ``steps``: w = h_i / (h_i + h_j), where h is the number of local steps each partner took
  this round (exchanged along with the parameters). Meant for the time-budgeted mode, where
  a slow worker takes fewer steps: the model that did more work counts more, as FedAvg
  weights clients by samples. Both partners still end equal, but the global mean moves
  towards the faster workers (no longer invariant).

What the exchange carries besides the weights (BatchNorm buffers, optimizer momentum) follows
the training config's averaging policy (``ModelAverager.tensors()``, ``policy.batchnorm`` and
``policy.momentum``; ``reset`` zeroes the momentum after each pairwise average).
"""
from __future__ import annotations

from typing import Any, Iterable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..comm.base import Communicator
from ..comm.fusion import flatten, unflatten_
from ..topology import make_graph
from . import BuildContext, Spec
from .base import RoundAlgorithm
from .decentral import LocalSteps, ParamsOnly, reset_momentum_if_asked


class SwarmParams(BaseModel):
    """``algorithm.params`` of ``swarm``."""

    model_config = ConfigDict(extra="forbid")
    local_steps: int = Field(4, ge=1, description="H: local steps per round (mean H for geometric)")
    schedule: Literal["fixed", "geometric", "time"] = Field(
        "fixed", description="fixed H | geometric (mean H, per worker and round) | time (round_seconds budget)")
    round_seconds: Optional[float] = Field(None, gt=0, description="wall-clock budget of a round (schedule=time)")
    topology: Literal["complete", "ring", "regular"] = Field("complete", description="graph of possible partners")
    degree: Optional[int] = Field(None, ge=1, description="degree r of the regular topology")
    weighting: Literal["equal", "steps"] = Field("equal", description="equal: 1/2 each | steps: by local steps taken")
    seed: Optional[int] = Field(None, description="seed of matchings and geometric draws (default: the run seed)")

    @model_validator(mode="after")
    def _check(self):
        if self.schedule == "time" and self.round_seconds is None:
            raise ValueError("schedule=time needs round_seconds")
        if self.topology == "regular" and self.degree is None:
            raise ValueError("topology=regular needs degree")
        return self

    def time_round_steps(self) -> Optional[int]:
        """schedule=time: a round of round_seconds is meant to hold local_steps steps (else None: its steps
        do not depend on time; ``algorithms.time_round_steps``)."""
        return self.local_steps if self.schedule == "time" else None


class SwarmSGD(RoundAlgorithm):
    name = "swarm"
    Params = SwarmParams

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 comm: Communicator, *, local_steps: int = 4, schedule: str = "fixed",
                 round_seconds: Optional[float] = None, topology: str = "complete", degree: Optional[int] = None,
                 weighting: str = "equal", seed: int = 0, averager=None) -> None:
        super().__init__(params, optimizer, comm)
        if weighting not in ("equal", "steps"):
            raise ValueError(f"weighting {weighting!r}: expected equal|steps")
        self.graph = make_graph(topology, comm.world_size, degree)
        self.seed = int(seed)
        self.weighting = weighting
        self.averager = averager if averager is not None else ParamsOnly(self.params, comm)
        self.local = LocalSteps(schedule, local_steps, round_seconds, seed=self.seed, rank=comm.rank)
        self.nominal_steps_per_round = int(local_steps)
        self.rounds_done = 0
        self.steps_in_round = 0
        self.round_finished = False  # True right after the step that ended a round
        self.sat_out = 0
        self.local.start_round(0)

    @property
    def variable_steps(self) -> bool:
        """Workers may take different numbers of steps per round (geometric/time schedules)."""
        return self.local.variable

    def after_step(self) -> None:
        self.steps_in_round += 1
        self.round_finished = False
        if self.local.due(self.steps_in_round):
            self.communicate()

    def communicate(self) -> Optional[int]:
        """End the current round: average with this round's partner. Returns the partner."""
        partner = self.graph.matching(self.seed, self.rounds_done)[self.comm.rank]
        tensors = self.averager.tensors()
        x = flatten(tensors)
        if self.weighting == "steps":
            x = torch.cat([x, torch.tensor([float(self.steps_in_round)], dtype=x.dtype, device=x.device)])
        got = self.comm.exchange([x], partner)
        if partner is not None:
            y = got[0]
            if self.weighting == "steps":
                # same operations in the same order on both partners -> bitwise-equal results; tensor
                # arithmetic on the model's device (no host round trip of the step counts)
                lo, hi = (x, y) if self.comm.rank < partner else (y, x)
                w = lo[-1:] / (lo[-1:] + hi[-1:])
                avg = lo[:-1] * w + hi[:-1] * (1.0 - w)
            else:
                avg = x.mul_(0.5).add_(y, alpha=0.5)
            unflatten_(avg, tensors)
            reset_momentum_if_asked(self.averager)
        else:
            self.sat_out += 1
        self.rounds_done += 1
        self.steps_in_round = 0
        self.round_finished = True
        self.local.start_round(self.rounds_done)
        return partner

    def reset_clock(self) -> None:
        """Restart the time budget of the current round (call after an evaluation pause)."""
        self.local.reset_clock()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rounds_done": self.rounds_done, "steps_in_round": self.steps_in_round,
                "target": self.local.target}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds_done = int(state.get("rounds_done", 0))
        self.steps_in_round = int(state.get("steps_in_round", 0))
        self.local.start_round(self.rounds_done)
        self.local.target = int(state.get("target", self.local.target))


def build(params: SwarmParams, ctx: BuildContext) -> SwarmSGD:
    seed = params.seed if params.seed is not None else ctx.seed
    return SwarmSGD(ctx.model.parameters(), ctx.optimizer, ctx.comm, local_steps=params.local_steps,
                    schedule=params.schedule, round_seconds=params.round_seconds, topology=params.topology,
                    degree=params.degree, weighting=params.weighting, seed=seed, averager=ctx.policy)


SPECS = {"swarm": Spec(SwarmParams, build)}
