"""Parameter averaging and its explicit policy for BatchNorm buffers and optimizer momentum.

``ModelAverager.average_(group)`` averages, in ONE fused collective over ``group``:

* all parameters;
* BatchNorm running mean/var when ``batchnorm="average"`` (``"local"``: each worker keeps its
  own statistics; ``num_batches_tracked`` is always local);
* the base optimizer's momentum state when ``momentum="average"`` (SGD ``momentum_buffer``,
  Adam ``exp_avg`` and ``exp_avg_sq``); ``"reset"`` zeroes that state after averaging
  (a fresh start of momentum from the averaged point); ``"local"`` leaves it alone.

Every algorithm that averages parameters (local SGD, post-local SGD, hierarchical, SlowMo)
goes through this class, so the policy is the same everywhere. AR-SGD averages gradients,
not parameters; its BatchNorm statistics are averaged only for evaluation
(``pipeline.train.worker.Worker.evaluation_weights``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm.base import Communicator, Group

MOMENTUM_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def bn_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The running mean and variance of every normalisation layer that tracks them (BatchNorm*,
    SyncBatchNorm, InstanceNorm* with ``track_running_stats``), found by their public attributes."""
    out = []
    for m in model.modules():
        if getattr(m, "track_running_stats", False):
            out += [b for b in (getattr(m, "running_mean", None), getattr(m, "running_var", None))
                    if isinstance(b, torch.Tensor)]
    return out


class ModelAverager:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                 batchnorm: str = "average", momentum: str = "local") -> None:
        if batchnorm not in ("average", "local"):
            raise ValueError(f"batchnorm policy {batchnorm!r}: average | local")
        if momentum not in ("local", "average", "reset"):
            raise ValueError(f"momentum policy {momentum!r}: local | average | reset")
        self.model, self.optimizer, self.comm = model, optimizer, comm
        self.batchnorm, self.momentum = batchnorm, momentum
        self.params = [p for p in model.parameters()]

    def momentum_state(self) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            st = self.optimizer.state.get(p, {})
            out += [st[k] for k in MOMENTUM_KEYS if isinstance(st.get(k), torch.Tensor)]
        return out

    def tensors(self) -> list[torch.Tensor]:
        ts = [p.data for p in self.params]
        if self.batchnorm == "average":
            ts += bn_buffers(self.model)
        if self.momentum == "average":
            ts += self.momentum_state()
        return ts

    def average_(self, group: Optional[Group] = None) -> None:
        self.comm.allreduce_mean_(self.tensors(), group)
        if self.momentum == "reset":
            for t in self.momentum_state():
                t.zero_()
