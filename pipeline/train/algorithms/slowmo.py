"""SlowMo (Wang et al. 2019) around any base algorithm, and its "no average" variant.

Every ``tau`` base steps (the outer step)::

    x  <- average of x over the world        (skipped when average=False)
    u  <- beta * u + (x0 - x) / lr           (lr: the base optimizer's CURRENT learning rate)
    x  <- x0 - alpha * lr * u
    x0 <- x

With beta = 0 and alpha = 1 the outer step is the identity after the average, so SlowMo
equals its base algorithm (plus the exact average). With lr = 1 the outer step is torch's
SGD with momentum ``beta`` (dampening 0) and step ``alpha`` on the pseudo-gradient x0 - x.

x0 is captured in ``on_start``, i.e. after rank 0's initial weights were broadcast (the worker
calls it then; a SlowMo used without a worker captures it before its first step).

``average=False`` (Migliorini 2020): each worker keeps its own slow-momentum buffer and skips
the global average, so workers couple only through the base algorithm.

Around a base whose workers take different numbers of steps per round (a round-driven
:class:`~.base.RoundAlgorithm`: time-budgeted local SGD or SwarmSGD, geometric SwarmSGD),
:class:`RoundSlowMo` counts ``tau`` in ROUNDS, so every worker reaches the outer step's
all-reduce at the same round; the builder picks it (:func:`slowmo_for`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import BuildContext, Spec, build_algorithm, time_round_steps, validate_params
from .averaging import ModelAverager
from .base import Algorithm, RoundAlgorithm, is_round_driven


class SlowMo(Algorithm):
    name = "slowmo"

    def __init__(self, base: Algorithm, averager: ModelAverager, tau: int, beta: float, alpha: float,
                 average: bool = True):
        super().__init__(base.params, base.optimizer, base.comm)
        self.base, self.averager = base, averager
        self.tau, self.beta, self.alpha, self.average = int(tau), float(beta), float(alpha), bool(average)
        self.x0: Optional[list[torch.Tensor]] = None
        self.u = [torch.zeros_like(p) for p in self.params]

    def on_start(self, worker: Any = None) -> None:
        self.base.on_start(worker)
        self.x0 = [p.detach().clone() for p in self.params]

    def on_finish(self, worker: Any = None) -> None:
        self.base.on_finish(worker)

    # the base's hooks pass through (e.g. an asynchronous base's thread, metrics and centre)
    @property
    def owns_communication(self) -> bool:  # type: ignore[override]
        return self.base.owns_communication

    def close(self) -> None:
        self.base.close()

    def eval_metrics(self) -> dict[str, Any]:
        return self.base.eval_metrics()

    def summary_stats(self) -> dict[str, Any]:
        return self.base.summary_stats()

    def evaluation_tensors(self) -> Optional[list[torch.Tensor]]:
        return self.base.evaluation_tensors()

    def extra_evaluations(self) -> dict[str, list[torch.Tensor]]:
        return self.base.extra_evaluations()

    def _outer_due(self, n: int) -> bool:
        """Whether the outer step follows base step ``n`` (1-based)."""
        return n % self.tau == 0

    def before_step(self) -> None:
        if self.x0 is None:
            self.on_start()

    def apply_step(self) -> None:
        self.base.step()

    def after_step(self) -> None:
        if self._outer_due(self.step_count + 1):
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        if self.x0 is None:
            raise RuntimeError("SlowMo.outer_step before on_start: x0 was never captured")
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
        if self.average and self._outer_due(self.step_count):
            return True
        return self.base.in_sync() and (self.average or self.beta == 0.0 and self.alpha == 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "base": self.base.state_dict(),
                "x0": None if self.x0 is None else [t.clone() for t in self.x0], "u": [t.clone() for t in self.u]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.base.load_state_dict(state["base"])
        if state["x0"] is not None:
            self.x0 = [t.detach().clone() for t in self.params] if self.x0 is None else self.x0
            for dst, src in zip(self.x0, state["x0"]):
                dst.copy_(src)
        for dst, src in zip(self.u, state["u"]):
            dst.copy_(src)


class RoundSlowMo(SlowMo, RoundAlgorithm):
    """SlowMo whose outer step comes every ``tau`` ROUNDS of a round-driven base."""

    variable_steps = True

    def __init__(self, base: RoundAlgorithm, averager, tau: int, beta: float, alpha: float, average: bool = True):
        if not is_round_driven(base):
            raise ValueError(f"RoundSlowMo needs a round-driven base (variable_steps), got {base.name}")
        super().__init__(base, averager, tau, beta, alpha, average)
        self.round_base = base

    @property
    def rounds_done(self) -> int:
        return self.round_base.rounds_done

    @property
    def round_finished(self) -> bool:
        return self.round_base.round_finished

    @property
    def nominal_steps_per_round(self) -> int:
        return self.round_base.nominal_steps_per_round

    def reset_clock(self) -> None:
        self.round_base.reset_clock()

    def _outer_due(self, n: int) -> bool:
        return self.round_base.round_finished and self.round_base.rounds_done % self.tau == 0


def slowmo_for(base: Algorithm, averager, tau: int, beta: float, alpha: float, average: bool = True) -> SlowMo:
    """SlowMo (tau in steps) for a fixed-steps base, RoundSlowMo (tau in rounds) for a round-driven one."""
    cls = RoundSlowMo if is_round_driven(base) else SlowMo
    return cls(base, averager, tau, beta, alpha, average)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base: str = Field("local_sgd", description="base algorithm (any registered name but slowmo)")
    base_params: dict = Field(default_factory=dict, description="parameters of the base algorithm")
    tau: int = Field(8, ge=1, description="base steps per outer step (rounds, around a round-driven base)")
    beta: float = Field(0.5, ge=0, lt=1, description="slow momentum")
    alpha: float = Field(1.0, gt=0, description="slow learning rate")
    average: bool = Field(True, description="exact average before the outer step (False: no-average variant)")

    @model_validator(mode="after")
    def _base(self):
        if self.base == "slowmo":
            raise ValueError("SlowMo cannot wrap itself")
        validate_params(self.base, self.base_params)
        return self

    def time_round_steps(self):
        """Its base algorithm's (``algorithms.time_round_steps``)."""
        return time_round_steps(self.base, self.base_params)


def build(params: Params, ctx: BuildContext) -> SlowMo:
    base = build_algorithm(params.base, params.base_params, ctx)
    return slowmo_for(base, ctx.policy, params.tau, params.beta, params.alpha, params.average)


SPECS = {"slowmo": Spec(Params, build)}
