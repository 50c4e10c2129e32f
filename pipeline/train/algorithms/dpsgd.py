"""D-PSGD (Lian et al. 2017): gossip with the neighbours of a fixed mixing matrix every step.

Each step, with the stochastic gradient g_i computed at the worker's current x_i::

    x_i <- sum_j W[i, j] x_j - lr * g_i          (order="cta": combine, then adapt; Lian et al.)

W is a fixed symmetric doubly stochastic matrix supported on the communication graph (ring
by default; Metropolis-Hastings weights, see :mod:`pipeline.train.topology`), or any such
matrix passed as ``mixing``. ``order="atc"`` (adapt, then combine: step first, then mix) is
the other common form; with W = 1/M and plain SGD it is exactly AR-SGD.

The mixing is applied with pairwise exchanges: the graph's edges are split into matchings
(:meth:`Graph.exchange_rounds`, 2-3 rounds for a ring) and each round is one
``comm.exchange`` of the flat parameter vector, so a worker only ever talks to its
neighbours (point to point on torch.distributed). Every exchange sends the worker's
*pre-mixing* vector, so the result is exactly W x. When W is the uniform 1/M matrix
(complete graph) the same result is obtained with one all-reduce (``uniform_allreduce``).

With the base optimizer's momentum, the step applied after mixing is the optimizer's own
update (the momentum buffers stay local unless the averaging policy says otherwise).
"""
from __future__ import annotations

from typing import Iterable, Literal, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..comm.base import Communicator
from ..comm.fusion import flatten, unflatten_
from ..topology import Graph, make_graph
from . import BuildContext, Spec
from .base import Algorithm
from .decentral import ParamsOnly, reset_momentum_if_asked


class DPSGDParams(BaseModel):
    """``algorithm.params`` of ``dpsgd``."""

    model_config = ConfigDict(extra="forbid")
    topology: Literal["complete", "ring", "regular"] = Field("ring", description="graph of the mixing matrix")
    degree: Optional[int] = Field(None, ge=1, description="degree r of the regular topology")
    order: Literal["cta", "atc"] = Field("cta", description="cta: mix then apply the gradient (Lian) | atc: step then mix")
    uniform_allreduce: bool = Field(True, description="apply a uniform 1/M matrix with one all-reduce")

    @model_validator(mode="after")
    def _check(self):
        if self.topology == "regular" and self.degree is None:
            raise ValueError("topology=regular needs degree")
        return self

    def time_round_steps(self) -> None:
        """None: its steps do not depend on time (``algorithms.time_round_steps``)."""
        return None


def check_mixing_matrix(w: np.ndarray, n: int, tol: float = 1e-9) -> None:
    """Raise ``ValueError`` unless ``w`` is an n x n symmetric, non-negative, doubly stochastic matrix."""
    w = np.asarray(w, dtype=np.float64)
    if w.shape != (n, n):
        raise ValueError(f"mixing matrix has shape {w.shape}, expected ({n}, {n})")
    if (w < -tol).any():
        raise ValueError("mixing matrix has negative entries")
    if not np.allclose(w, w.T, atol=tol):
        raise ValueError("mixing matrix is not symmetric")
    if not (np.allclose(w.sum(0), 1, atol=tol) and np.allclose(w.sum(1), 1, atol=tol)):
        raise ValueError("mixing matrix is not doubly stochastic")


def graph_of(w: np.ndarray) -> Graph:
    """The support graph of a mixing matrix (off-diagonal non-zeros)."""
    n = w.shape[0]
    nb = tuple(tuple(j for j in range(n) if j != i and w[i, j] != 0) for i in range(n))
    return Graph("custom", n, nb)


class DPSGD(Algorithm):
    name = "dpsgd"
    Params = DPSGDParams

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 comm: Communicator, *, topology: str = "ring", degree: Optional[int] = None,
                 mixing: Optional[np.ndarray] = None, order: str = "cta", uniform_allreduce: bool = True,
                 averager=None) -> None:
        super().__init__(params, optimizer, comm)
        if order not in ("cta", "atc"):
            raise ValueError(f"order {order!r}: expected cta|atc")
        n = comm.world_size
        if mixing is None:
            self.graph = make_graph(topology, n, degree)
            self.W = self.graph.mixing_matrix()
        else:
            self.W = np.asarray(mixing, dtype=np.float64)
            check_mixing_matrix(self.W, n)
            self.graph = graph_of(self.W)
        self.order = order
        self.uniform = bool(uniform_allreduce) and np.allclose(self.W, 1.0 / n)
        self.rounds = self.graph.exchange_rounds()
        self.averager = averager if averager is not None else ParamsOnly(self.params, comm)

    def mix(self) -> None:
        """x_i <- sum_j W[i, j] x_j over the worker's neighbours (collective over the world)."""
        tensors = self.averager.tensors()
        if self.comm.world_size == 1:
            return
        x = flatten(tensors)
        if self.uniform:
            self.comm.allreduce_mean_([x])
            unflatten_(x, tensors)
        else:
            me = self.comm.rank
            acc = x * float(self.W[me, me])
            for partners in self.rounds:
                p = partners[me]
                if self.comm.collective_exchange or p is not None:
                    got = self.comm.exchange([x], p)
                    if p is not None:
                        acc.add_(got[0], alpha=float(self.W[me, p]))
            unflatten_(acc, tensors)
        reset_momentum_if_asked(self.averager)

    def in_sync(self) -> bool:
        return self.uniform and self.order == "atc"

    def before_step(self) -> None:
        if self.order == "cta":
            self.mix()

    def after_step(self) -> None:
        if self.order == "atc":
            self.mix()


def build(params: DPSGDParams, ctx: BuildContext) -> DPSGD:
    return DPSGD(ctx.model.parameters(), ctx.optimizer, ctx.comm, topology=params.topology, degree=params.degree,
                 order=params.order, uniform_allreduce=params.uniform_allreduce, averager=ctx.policy)


SPECS = {"dpsgd": Spec(DPSGDParams, build)}
