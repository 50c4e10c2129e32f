"""A training step's compute time per local batch size, for the cluster cost model's clock: measured
on this machine (:func:`measure_profile`) or given for named hardware with the source of its
numbers (:class:`ComputeProfile`)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from .costmodel import check_number


@dataclass(frozen=True)
class ComputeProfile:
    """Seconds of one training step (forward, backward, update) per local batch size, and where the
    numbers come from (a measurement on this machine, or a named device and its source)."""

    step_s: Mapping[int, float]
    source: str

    def __post_init__(self) -> None:
        if not self.step_s:
            raise ValueError("a compute profile needs at least one batch size")
        for b, s in self.step_s.items():
            if int(b) < 1:
                raise ValueError(f"batch size {b}: must be >= 1")
            check_number(f"step_s[{b}]", s, positive=True)
        if not str(self.source).strip():
            raise ValueError("a compute profile needs the source of its numbers")

    def seconds(self, batch: int) -> float:
        """A step's seconds at ``batch``: measured, or linear between the two measured sizes around it."""
        b = int(batch)
        pts = sorted((int(k), float(v)) for k, v in self.step_s.items())
        for k, v in pts:
            if k == b:
                return v
        if not pts[0][0] < b < pts[-1][0]:
            raise ValueError(f"batch size {b} outside the profile's measured {pts[0][0]}..{pts[-1][0]} "
                             f"({self.source})")
        for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
            if b0 < b < b1:
                return s0 + (s1 - s0) * (b - b0) / (b1 - b0)
        raise AssertionError("unreachable")


def measure_profile(step: Callable[[int], None], batches: Iterable[int], warmup: int = 2, repeats: int = 5,
                    clock: Callable[[], float] = time.perf_counter, source: str = "measured on this machine"
                    ) -> ComputeProfile:
    """Time ``step(batch)`` on this machine: ``warmup`` untimed calls, then the median of ``repeats``
    timed ones, per batch size."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup={warmup}, repeats={repeats}: warmup >= 0 and repeats >= 1")
    out: dict[int, float] = {}
    for b in batches:
        for _ in range(warmup):
            step(int(b))
        times = []
        for _ in range(repeats):
            t0 = clock()
            step(int(b))
            times.append(clock() - t0)
        out[int(b)] = max(statistics.median(times), 1e-9)
    return ComputeProfile(out, source)
