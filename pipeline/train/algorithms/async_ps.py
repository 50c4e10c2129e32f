"""Asynchronous parameter-server SGD (Downpour-style; Dean et al. 2012), the baseline of EA-wild.

The model lives on the holder, rank 0 (:class:`~.centre.CentreHolder`). Every local step,
worker j pushes its gradient ``g_j`` (computed on the model it pulled last) with its current
learning rate rescaled from the global batch (for which the configured rate is scaled) to one
local batch: divided by M for SGD (linear rule), by sqrt(M) for Adam (square-root rule of
Malladi et al. 2022); the holder applies it at once with its own instance of the base optimizer
(:class:`ServerOptimizer`: same kind and hyper-parameters, Adam or SGD with momentum), one push
after the other, and replies with the updated model, which the worker copies into its
parameters: that is its next pull. No worker waits for another, only for the holder's reply.
**Staleness** = the updates of other workers applied between a worker's pull and its push.

At every round end the holder's model is broadcast to all workers (a collective at a quiesced
round boundary, see :mod:`.async_common`), so the workers are in sync there and the evaluated
model is the server's. Before the next round's gate opens, the holder's model is reset to the
workers' (identical) model, which SlowMo's outer step may have moved. The server optimizer's
state (its moments) is part of rank 0's checkpoint.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..comm.fusion import flatten, unflatten_
from . import BuildContext, Spec
from .async_common import AsyncParams
from .centre import CentreAlgorithm


class AsyncPSParams(AsyncParams):
    """``algorithm.params`` of ``async_ps``."""


class ServerOptimizer:
    """rule(c, payload=[g, lr]): one step of the base optimizer's kind on the flat model c."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.kind = type(optimizer)
        self.defaults = {k: v for k, v in optimizer.defaults.items() if k != "params"}
        self.param: Optional[torch.nn.Parameter] = None
        self.opt: Optional[torch.optim.Optimizer] = None
        self._restored: dict[str, Any] = {}

    def __call__(self, c: torch.Tensor, payload: torch.Tensor) -> None:
        if self.param is None or self.param.data.data_ptr() != c.data_ptr():
            self.param = torch.nn.Parameter(c, requires_grad=True)  # shares c's storage
            self.opt = self.kind([self.param], **self.defaults)
            if self._restored:
                self.opt.state[self.param] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                              for k, v in self._restored.items()}
        self.opt.param_groups[0]["lr"] = float(payload[-1])
        self.param.grad = payload[:-1].to(c.dtype).clone()
        self.opt.step()

    def state(self) -> dict[str, Any]:
        """The optimizer's per-parameter state (moments, step): tensors and plain numbers."""
        if self.opt is None:
            return dict(self._restored)
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.opt.state[self.param].items()}

    def restore(self, state: Optional[dict[str, Any]]) -> None:
        self._restored = dict(state or {})


class AsyncPS(CentreAlgorithm):
    name = "async_ps"

    def __init__(self, params, optimizer, comm, averager=None, **kw) -> None:
        super().__init__(params, optimizer, comm, averager, **kw)
        self.rule = ServerOptimizer(optimizer)
        m = comm.world_size  # a push is one local batch: SGD's linear rule (lr / M), Adam's square-root rule
        self.push_lr_divisor = float(m) if isinstance(optimizer, torch.optim.SGD) else m ** 0.5
        self.grad_params = list(self.params)
        self.tensors = [p.data for p in self.grad_params]  # the server holds the parameters only
        self.numel = sum(t.numel() for t in self.tensors)

    def begin_comm_round(self) -> None:
        if self.holder is not None:   # reset to the workers' model (SlowMo may have moved it) BEFORE the gate opens
            self.holder.reset(flatten(self.tensors, device="cpu"))
        super().begin_comm_round()

    def local_step(self) -> None:
        if self.comm.world_size == 1:
            with self.lock:
                self.optimizer.step()
            return
        g = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.grad_params],
                    dtype=self.dtype, device="cpu")
        lr = float(self.optimizer.param_groups[0]["lr"]) / self.push_lr_divisor
        c = self.link.push(torch.cat([g, torch.tensor([lr], dtype=self.dtype)]))
        with self.lock:
            unflatten_(c, self.grad_params)

    def end_comm_round(self) -> None:
        super().end_comm_round()
        c = self.centre_flat()  # collective: every worker takes the server's model
        with self.lock:
            unflatten_(c, self.grad_params)

    def in_sync(self) -> bool:
        return self.comm.world_size == 1 or (self.round_finished and self.steps_in_round == 0)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.comm.rank == 0:
            state["server_state"] = self.rule.state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rule.restore(state.get("server_state"))


def build(params: AsyncPSParams, ctx: BuildContext) -> AsyncPS:
    return AsyncPS(ctx.model.parameters(), ctx.optimizer, ctx.comm, ctx.policy, round_steps=params.round_steps,
                   round_seconds=params.round_seconds, timeout_s=params.timeout_s)


SPECS = {"async_ps": Spec(AsyncPSParams, build)}
