"""Shared pieces of the decentralized algorithms (SwarmSGD, D-PSGD, EASGD, time-budgeted local SGD).

The tensors an averaging step touches (chosen by the training config's averaging policy,
``ModelAverager.tensors()``: parameters, plus BatchNorm statistics and optimizer momentum when
the policy says ``average``) travel as ONE contiguous vector (``comm.fusion.flatten`` /
``unflatten_``), so that an exchange or an all-reduce is one message, not one per tensor.

* :class:`LocalSteps` -- how many local steps a worker takes before it communicates:
  ``fixed`` (H), ``geometric`` (a fresh H_i ~ Geometric(1/H) per worker and round, mean H,
  drawn from ``default_rng([seed, rank, round])`` so a resumed run redraws the same value),
  or ``time`` (as many steps as fit in ``round_seconds`` of wall clock -- virtual seconds in a
  simulated run, :mod:`~..comm.simclock`; the time-budgeted mode, in which a slow worker simply
  takes fewer steps instead of making others wait).
"""
from __future__ import annotations

from typing import Literal, Optional, Sequence

import numpy as np
import torch

from ..comm import simclock

Schedule = Literal["fixed", "geometric", "time"]


def reset_momentum_if_asked(averager) -> None:
    """Apply the ``reset`` momentum policy of a :class:`~.averaging.ModelAverager` after a
    (partial) average that did not go through ``averager.average_``."""
    if averager.momentum == "reset":
        with torch.no_grad():
            for m in averager.momentum_state():
                m.zero_()


class LocalSteps:
    """When a worker's round of local steps is over (see module docstring)."""

    def __init__(self, schedule: Schedule = "fixed", local_steps: int = 1, round_seconds: Optional[float] = None,
                 seed: int = 0, rank: int = 0, clock=None) -> None:
        if schedule not in ("fixed", "geometric", "time"):
            raise ValueError(f"local-step schedule {schedule!r}: expected fixed|geometric|time")
        if schedule == "time" and not (round_seconds and round_seconds > 0):
            raise ValueError("the time-budgeted schedule needs round_seconds > 0")
        if local_steps < 1:
            raise ValueError(f"local_steps={local_steps}: need >= 1")
        self.schedule = schedule
        self.H = int(local_steps)
        self.round_seconds = round_seconds
        self.seed, self.rank = int(seed), int(rank)
        self._clock = clock if clock is not None else simclock.clock()
        self.target = self.H
        self.t0 = self._clock()

    @property
    def variable(self) -> bool:
        """True when workers may take different numbers of steps in a round."""
        return self.schedule != "fixed"

    def start_round(self, round_index: int) -> None:
        self.t0 = self._clock()
        if self.schedule == "geometric":
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.rank, int(round_index)])
            self.target = int(rng.geometric(1.0 / self.H))
        else:
            self.target = self.H

    def reset_clock(self) -> None:
        """Restart the round's wall-clock budget (e.g. after an evaluation pause)."""
        self.t0 = self._clock()

    def due(self, steps_in_round: int) -> bool:
        if steps_in_round < 1:
            return False
        if self.schedule == "time":
            return self._clock() - self.t0 >= self.round_seconds
        return steps_in_round >= self.target


class ParamsOnly:
    """Averaging policy when no ModelAverager is given: parameters only, momentum local."""

    momentum = "local"

    def __init__(self, params: Sequence[torch.Tensor], comm) -> None:
        self.params = list(params)
        self.comm = comm

    def average_(self, group=None) -> None:
        self.comm.allreduce_mean_(self.tensors(), group)

    def tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.params]

    def momentum_state(self) -> list[torch.Tensor]:
        return []
