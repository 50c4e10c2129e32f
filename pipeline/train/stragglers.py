"""Straggler simulator: make chosen workers slow, on purpose and reproducibly.

Real clusters have slow and unequal workers; decentralized and time-budgeted algorithms are
meant to tolerate them. To measure that on one machine, the worker wraps each step's
compute (forward and backward) in :meth:`StragglerSimulator.compute`::

    with stragglers.compute():
        loss = F.cross_entropy(model(*inputs), y)
        loss.backward()
    algo.step()            # optimizer step and communication: outside, not slowed down

After the wrapped block the simulator sleeps for

* ``(slowdown[rank] - 1) * elapsed`` -- a worker with factor 2 takes twice as long per step
  as it would on its own (the factor multiplies the *measured* compute time, so it tracks
  whatever the machine is doing), and
* ``delay_s`` with probability ``delay_prob`` -- random hiccups (GC pauses, a noisy neighbour).

It *sleeps* rather than spins: a simulated straggler is slow without taking CPU away from
the other workers on the same machine, which a busy loop would do on a small host.

The random delays come from ``numpy.random.default_rng([seed, rank])`` with exactly one draw
per step, delayed or not, so the sequence of delayed steps of a worker is a pure function of
(seed, rank, step) and a rerun reproduces it. The optimizer step and communication are not
touched: only forward and backward are wrapped.

In a simulated run (the ``inprocess`` launcher's simulated clock, :mod:`.comm.simclock`) the
wrapped block takes no virtual time of its own: the step's virtual compute time comes from the
simulation's per-worker model, and the factor and the random delay apply to it the same way
(``slowdown[rank] * t + delay``), so they decide the interleaving instead of the machine's load.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StragglerConfig(BaseModel):
    """Simulated slow workers (all off by default)."""

    model_config = ConfigDict(extra="forbid")
    slowdown: dict[int, float] = Field(default_factory=dict,
                                       description="worker rank -> factor >= 1 on its compute time, e.g. {3: 2.0}")
    delay_s: float = Field(0.0, ge=0, description="extra sleep of a randomly delayed step (seconds)")
    delay_prob: float = Field(0.0, ge=0, le=1, description="probability that a step of any worker is delayed")
    seed: int = Field(0, description="seed of the random delays (per worker: [seed, rank])")

    @field_validator("slowdown")
    @classmethod
    def _factors(cls, v: dict[int, float]) -> dict[int, float]:
        for rank, f in v.items():
            if rank < 0:
                raise ValueError(f"worker rank {rank} must be >= 0")
            if not f >= 1.0:
                raise ValueError(f"slowdown factor {f} of worker {rank} must be >= 1")
        return v

    @property
    def active(self) -> bool:
        return any(f > 1.0 for f in self.slowdown.values()) or (self.delay_s > 0 and self.delay_prob > 0)


class SimClockConfig(BaseModel):
    """The simulated clock of the ``inprocess`` launcher (``pipeline.train.comm.simclock``): the per-worker
    compute-time model and the message delays of the runs that depend on time."""

    model_config = ConfigDict(extra="forbid")
    step_s: Optional[float] = Field(None, gt=0, description="virtual compute time of one training step (forward + "
                                    "backward); default: a time budget's own step (round_seconds / round_steps, "
                                    "nominal_steps or local_steps), else 0.01")
    step_jitter: float = Field(0.1, ge=0, lt=1, description="a step takes step_s x u, u uniform in [1 - j, 1 + j], "
                                                            "drawn per (seed, rank, step)")
    latency_s: float = Field(0.0005, ge=0, description="virtual delay of every message and collective")
    bytes_per_s: float = Field(1e9, gt=0, description="virtual bandwidth: a message of n bytes takes n / bytes_per_s more")
    seed: Optional[int] = Field(None, description="seed of the compute times and of the order of equal times "
                                                  "(default: the run seed)")
    always: bool = Field(False, description="every inprocess run under the simulated clock, also one whose result "
                                            "does not depend on time (default: only those that do)")


class StragglerSimulator:
    """Per-worker slowdown and random delays around the compute step (see module docstring)."""

    def __init__(self, cfg: StragglerConfig | None, rank: int,
                 sleep=time.sleep, clock=time.perf_counter) -> None:
        self.cfg = cfg or StragglerConfig()
        self.rank = int(rank)
        self.factor = float(self.cfg.slowdown.get(self.rank, 1.0))
        self._rng = np.random.default_rng([int(self.cfg.seed) & 0xFFFFFFFF, self.rank])
        self._sleep = sleep
        self._clock = clock
        self.steps = 0
        self.delayed_steps = 0
        self.injected_s = 0.0  # total simulated extra time of this worker
        from .comm import simclock

        self.simulated = simclock.current() is not None   # a step's time is virtual (module docstring)

    @property
    def active(self) -> bool:
        return self.factor > 1.0 or (self.cfg.delay_s > 0 and self.cfg.delay_prob > 0)

    def extra_seconds(self, elapsed: float) -> float:
        """Extra time for one step that took ``elapsed`` seconds (advances the random stream)."""
        extra = (self.factor - 1.0) * max(elapsed, 0.0)
        if self.cfg.delay_prob > 0:
            if self._rng.random() < self.cfg.delay_prob:
                extra += self.cfg.delay_s
                self.delayed_steps += 1
        self.steps += 1
        return extra

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Wrap one compute step; sleeps afterwards as configured (a no-op when inactive). In a
        simulated run: the step's virtual compute time, slowed and delayed as configured."""
        if self.simulated:
            from .comm import simclock

            yield
            before = self.injected_s
            extra = [0.0]

            def slowed(base: float) -> float:
                extra[0] = self.extra_seconds(base)
                return extra[0]

            simclock.compute_step(self.rank, slowed)
            self.injected_s = before + extra[0]
            return
        if not self.active:
            yield
            return
        t0 = self._clock()
        yield
        extra = self.extra_seconds(self._clock() - t0)
        if extra > 0:
            self._sleep(extra)
            self.injected_s += extra

    def stats(self) -> dict:
        return {"straggler_factor": self.factor, "straggler_delayed_steps": self.delayed_steps,
                "straggler_injected_s": round(self.injected_s, 6)}


def delay_schedule(cfg: StragglerConfig, rank: int, steps: int) -> np.ndarray:
    """Boolean array: which of the first ``steps`` steps of ``rank`` get a random delay."""
    sim = StragglerSimulator(cfg, rank)
    return np.array([sim.extra_seconds(0.0) > 0 for _ in range(steps)], dtype=bool)
