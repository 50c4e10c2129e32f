"""Base class of every training algorithm, in the spirit of PyTorch's model averagers.

An algorithm wraps a model's parameters, a base torch optimizer and a Communicator, and
replaces ``optimizer.step()`` in the training loop::

    loss.backward()
    algo.step()          # before_step() -> optimizer.step() -> after_step()

It knows nothing about Spark, Horovod or torch.distributed; it talks only to the
communication interface (``pipeline.train.comm.base.Communicator``). Composition
(e.g. SlowMo around local SGD) is done by wrapping one algorithm in another.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..comm.base import Communicator


class Algorithm:
    name = "base"

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 comm: Communicator) -> None:
        self.params = [p for p in params]
        self.optimizer = optimizer
        self.comm = comm
        self.step_count = 0  # number of completed step() calls

    # hooks
    def before_step(self) -> None:
        """After backward, before the base optimizer step (e.g. average gradients)."""

    def after_step(self) -> None:
        """After the base optimizer step (e.g. average parameters every H steps)."""

    def step(self) -> None:
        self.before_step()
        self.optimizer.step()
        self.after_step()
        self.step_count += 1

    def in_sync(self) -> bool:
        """True when, after the last step, every worker holds the same parameters."""
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state.get("step_count", 0))
