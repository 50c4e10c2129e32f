"""SlowMo (Wang et al. 2019) around any base algorithm, and its "no average" variant.

Every ``tau`` base steps (the outer step)::

    x  <- average of x over the world        (skipped when average=False)
    u  <- beta * u + (x0 - x) / lr           (lr: the base optimizer's CURRENT learning rate)
    x  <- x0 - alpha * lr * u
    x0 <- x

With beta = 0 and alpha = 1 the outer step is the identity after the average, so SlowMo
equals its base algorithm (plus the exact average). With lr = 1 the outer step is torch's
SGD with momentum ``beta`` (dampening 0) and step ``alpha`` on the pseudo-gradient x0 - x.

``average=False`` (Migliorini 2020): each worker keeps its own slow-momentum buffer and skips
the global average, so workers couple only through the base algorithm.
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import BuildContext, Spec, build_algorithm, validate_params
from .averaging import ModelAverager
from .base import Algorithm


class SlowMo(Algorithm):
    name = "slowmo"

    def __init__(self, base: Algorithm, averager: ModelAverager, tau: int, beta: float, alpha: float,
                 average: bool = True):
        super().__init__(base.params, base.optimizer, base.comm)
        self.base, self.averager = base, averager
        self.tau, self.beta, self.alpha, self.average = int(tau), float(beta), float(alpha), bool(average)
        self.x0 = [p.detach().clone() for p in self.params]
        self.u = [torch.zeros_like(p) for p in self.params]

    def step(self) -> None:
        self.base.step()
        self.step_count += 1
        if self.step_count % self.tau == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        if self.average:
            self.averager.average_()
        lr = float(self.optimizer.param_groups[0]["lr"])
        for p, x0, u in zip(self.params, self.x0, self.u):
            u.mul_(self.beta).add_((x0 - p.data) / lr)
            p.data.copy_(x0 - self.alpha * lr * u)
            x0.copy_(p.data)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none)

    def in_sync(self) -> bool:
        if self.average and self.step_count % self.tau == 0:
            return True
        return self.base.in_sync() and (self.average or self.beta == 0.0 and self.alpha == 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "base": self.base.state_dict(),
                "x0": [t.clone() for t in self.x0], "u": [t.clone() for t in self.u]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.base.load_state_dict(state["base"])
        for dst, src in zip(self.x0 + self.u, list(state["x0"]) + list(state["u"])):
            dst.copy_(src)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base: str = Field("local_sgd", description="base algorithm (any registered name but slowmo)")
    base_params: dict = Field(default_factory=dict, description="parameters of the base algorithm")
    tau: int = Field(8, ge=1, description="base steps per outer step")
    beta: float = Field(0.5, ge=0, lt=1, description="slow momentum")
    alpha: float = Field(1.0, gt=0, description="slow learning rate")
    average: bool = Field(True, description="exact average before the outer step (False: no-average variant)")

    @model_validator(mode="after")
    def _base(self):
        if self.base == "slowmo":
            raise ValueError("SlowMo cannot wrap itself")
        validate_params(self.base, self.base_params)
        return self


def build(params: Params, ctx: BuildContext) -> SlowMo:
    base = build_algorithm(params.base, params.base_params, ctx)
    return SlowMo(base, ctx.policy, params.tau, params.beta, params.alpha, params.average)


SPECS = {"slowmo": Spec(Params, build)}


# issue 7: around a base whose workers take different numbers of steps per round (time-budgeted
# or geometric local steps), tau counts ROUNDS (rounds.RoundSlowMo); otherwise unchanged.
def build(params: Params, ctx: BuildContext) -> SlowMo:  # noqa: F811
    from .rounds import slowmo_for

    base = build_algorithm(params.base, params.base_params, ctx)
    return slowmo_for(base, ctx.policy, params.tau, params.beta, params.alpha, params.average)


SPECS = {"slowmo": Spec(Params, build)}
