"""Elastic averaging SGD (Zhang et al. 2015), synchronous all-reduce form.

Workers explore locally and are tied to a centre variable x~ by an elastic force. Every
``tau`` steps, with x_bar the world average of the workers' parameters::

    x_i <- x_i - alpha * (x_i - x~)          each worker moves towards the centre
    x~  <- x~  + beta  * (x_bar - x~)        the centre moves towards the workers

both computed from the values before the update. The paper's symmetric choice beta = M*alpha
(default) makes the total pull on the workers equal the pull on the centre, so
sum_i x_i + x~ is unchanged by an elastic step. ``alpha`` is the moving rate; alternatively
give ``rho`` (the elastic coefficient) and alpha = lr * rho with the current learning rate,
as in the paper (alpha = eta * rho). The paper's recommended beta = 0.9 is the default
(alpha = 0.9 / M).

Every worker holds an identical copy of x~ (it is updated from the same all-reduced x_bar),
so no parameter server is needed: one all-reduce of the flat parameter vector per elastic
step. x~ is initialised, at the first step, to the world average of the initial parameters.

What the training run evaluates is a choice (``evaluate``):

* ``average`` (default): the world average of the workers' parameters, as for every other
  algorithm that leaves the workers apart;
* ``center``: the centre variable x~ (the paper's output model), identical on every rank, so
  evaluating it needs no communication (:meth:`EASGD.evaluation_tensors`); the final model
  is then the centre.

With ``average`` the centre is also scored on the test split at the end
(``centre_test_accuracy`` in the summary, :meth:`EASGD.extra_evaluations`).
"""
from __future__ import annotations

from typing import Any, Iterable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..comm.base import Communicator
from ..comm.fusion import flatten, split_like, unflatten_
from . import BuildContext, Spec
from .base import Algorithm
from .decentral import ParamsOnly, reset_momentum_if_asked


class EASGDParams(BaseModel):
    """``algorithm.params`` of ``easgd``."""

    model_config = ConfigDict(extra="forbid")
    tau: int = Field(4, ge=1, description="communication period (steps)")
    alpha: Optional[float] = Field(None, gt=0, lt=1, description="moving rate of the workers (default beta / M)")
    rho: Optional[float] = Field(None, gt=0, description="elastic coefficient: alpha = lr * rho (instead of alpha)")
    beta: Optional[float] = Field(None, gt=0, le=1, description="moving rate of the centre (default 0.9, or M*alpha)")
    evaluate: Literal["average", "center"] = Field(
        "average", description="model evaluated during and after training: average of the workers | center")

    @model_validator(mode="after")
    def _check(self):
        if self.alpha is not None and self.rho is not None:
            raise ValueError("give alpha or rho, not both")
        return self

    def time_round_steps(self) -> None:
        """None: its steps do not depend on time (``algorithms.time_round_steps``)."""
        return None


class EASGD(Algorithm):
    name = "easgd"
    Params = EASGDParams

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 comm: Communicator, *, tau: int = 4, alpha: Optional[float] = None, rho: Optional[float] = None,
                 beta: Optional[float] = None, averager=None, evaluate: str = "average") -> None:
        super().__init__(params, optimizer, comm)
        if tau < 1:
            raise ValueError(f"tau={tau}: need >= 1")
        if alpha is not None and rho is not None:
            raise ValueError("give alpha or rho, not both")
        if evaluate not in ("average", "center"):
            raise ValueError(f"evaluate={evaluate!r}: expected average|center")
        self.evaluate = evaluate
        m = comm.world_size
        self.tau = int(tau)
        self.rho = rho
        if alpha is None and rho is None:
            beta = 0.9 if beta is None else beta
            alpha = beta / m
        self._alpha = alpha
        self._beta = beta
        self.averager = averager if averager is not None else ParamsOnly(self.params, comm)
        self.centre: Optional[torch.Tensor] = None

    @property
    def alpha(self) -> float:
        if self.rho is not None:
            return float(self.optimizer.param_groups[0]["lr"]) * self.rho
        return float(self._alpha)

    @property
    def beta(self) -> float:
        return float(self._beta) if self._beta is not None else self.comm.world_size * self.alpha

    def before_step(self) -> None:
        if self.centre is None:  # first step: x~ = world average of the initial parameters
            self.centre = flatten(self.averager.tensors())
            self.comm.allreduce_mean_([self.centre])

    def after_step(self) -> None:
        if (self.step_count + 1) % self.tau == 0:
            self.elastic_step()

    def elastic_step(self) -> None:
        tensors = self.averager.tensors()
        x = flatten(tensors)
        if self.centre is None or self.centre.numel() != x.numel():  # e.g. momentum state appeared
            self.centre = x.clone()
            self.comm.allreduce_mean_([self.centre])
        xbar = x.clone()
        self.comm.allreduce_mean_([xbar])
        a, b = self.alpha, self.beta
        x.add_(x - self.centre, alpha=-a)
        self.centre.add_(xbar - self.centre, alpha=b)
        unflatten_(x, tensors)
        reset_momentum_if_asked(self.averager)

    def evaluation_tensors(self) -> Optional[list[torch.Tensor]]:
        """``evaluate=center``: the centre, shaped like ``averager.tensors()``; else None (the average)."""
        return self.centre_tensors() if self.evaluate == "center" else None

    def extra_evaluations(self) -> dict[str, list[torch.Tensor]]:
        return {"centre": self.centre_tensors()} if self.evaluate == "average" else {}

    def centre_tensors(self) -> list[torch.Tensor]:
        """The centre, shaped like ``averager.tensors()`` (as far as the centre covers them: momentum
        state that appeared after its last reset is not in it)."""
        tensors = self.averager.tensors()
        if self.centre is None:  # before the first step every rank holds rank 0's broadcast weights
            return [t.detach().clone() for t in tensors]
        return [v.clone() for v in split_like(self.centre, tensors)]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "centre": None if self.centre is None else self.centre.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        c = state.get("centre")
        self.centre = None if c is None else c.clone()


def build(params: EASGDParams, ctx: BuildContext) -> EASGD:
    return EASGD(ctx.model.parameters(), ctx.optimizer, ctx.comm, tau=params.tau, alpha=params.alpha,
                 rho=params.rho, beta=params.beta, averager=ctx.policy, evaluate=params.evaluate)


SPECS = {"easgd": Spec(EASGDParams, build)}
