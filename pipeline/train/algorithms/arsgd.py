"""AR-SGD: synchronous data parallelism by averaging gradients every step.

After ``backward()`` every worker's gradients are averaged over the world with the
communicator's fused (bucketed) allreduce, then the base optimizer steps. With identical
initial parameters every worker stays identical, and M workers with local batch b equal one
process with batch M*b on the same samples (for a mean-reduced loss).

The linear learning-rate scaling rule and gradual warmup (Goyal et al. 2017) are learning-rate
schedules, set in ``TrainConfig`` (``lr_scaling``, ``warmup_epochs``) and applied by the
training loop (``pipeline.train.lr_schedule``) for every algorithm.
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from . import BuildContext, Spec
from .base import Algorithm


class ARSGD(Algorithm):
    name = "arsgd"

    def before_step(self) -> None:
        grads = []
        for p in self.params:
            if p.grad is None:  # every rank must reduce the same list
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        self.comm.allreduce_mean_(grads)

    def in_sync(self) -> bool:
        return True


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def time_round_steps(self) -> None:
        """None: its steps do not depend on time (``algorithms.time_round_steps``)."""
        return None


def build(params: Params, ctx: BuildContext) -> ARSGD:
    return ARSGD(ctx.model.parameters(), ctx.optimizer, ctx.comm)


SPECS = {"arsgd": Spec(Params, build)}
