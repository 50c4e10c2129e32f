"""Local SGD and post-local SGD.

* ``local_sgd`` (period H): every worker takes H optimizer steps on its own data, then the
  parameters are averaged over the world (``ModelAverager``, which applies the BatchNorm and
  momentum policy). H = 1 is parameter averaging after every step.
* ``post_local_sgd`` (Lin et al. 2020): AR-SGD (gradient averaging) for the first
  ``switch_step`` steps, then local SGD with period H counted from the switch.
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from . import BuildContext, Spec
from .averaging import ModelAverager
from .base import Algorithm


class LocalSGD(Algorithm):
    name = "local_sgd"

    def __init__(self, params, optimizer, comm, averager: ModelAverager, period: int, switch_step: int = 0):
        super().__init__(params, optimizer, comm)
        if period < 1:
            raise ValueError(f"local SGD period H must be >= 1, got {period}")
        self.averager, self.period, self.switch_step = averager, int(period), int(switch_step)
        self.averaged_at: list[int] = []  # steps (1-based) after which parameters were averaged

    def before_step(self) -> None:
        if self.step_count < self.switch_step:  # post-local SGD: AR-SGD phase
            grads = []
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            self.comm.allreduce_mean_(grads)

    def _is_averaging_step(self, n: int) -> bool:
        return n > self.switch_step and (n - self.switch_step) % self.period == 0

    def after_step(self) -> None:
        n = self.step_count + 1
        if self._is_averaging_step(n):
            self.averager.average_()
            self.averaged_at.append(n)

    def in_sync(self) -> bool:
        n = self.step_count
        return n <= self.switch_step or self._is_averaging_step(n)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    period: int = Field(4, ge=1, description="H: local steps between parameter averages")

    def time_round_steps(self) -> None:
        """None: its steps do not depend on time (``algorithms.time_round_steps``)."""
        return None


class PostParams(Params):
    switch_step: int = Field(100, ge=0, description="AR-SGD for this many steps, then local SGD")


def build(params: Params, ctx: BuildContext) -> LocalSGD:
    return LocalSGD(ctx.model.parameters(), ctx.optimizer, ctx.comm, ctx.policy, params.period)


def build_post(params: PostParams, ctx: BuildContext) -> LocalSGD:
    algo = LocalSGD(ctx.model.parameters(), ctx.optimizer, ctx.comm, ctx.policy, params.period, params.switch_step)
    algo.name = "post_local_sgd"
    return algo


SPECS = {"local_sgd": Spec(Params, build), "post_local_sgd": Spec(PostParams, build_post)}
