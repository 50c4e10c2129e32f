"""The measurements of an asynchronous run: per-worker counters and the evaluation record's fields.

Every evaluation record of an asynchronous run carries (:func:`combine`, from every worker's
:meth:`AsyncStats.snapshot`): the staleness histogram and mean, each worker's idle fraction
(waiting at round ends, for the holder's reply or lock), exchanges per second, each worker's
averaging rate (exchanges per gradient step) and step rate, and the global step count. Times are
read from the clock of the thread that makes the counters: virtual seconds in a simulated run
(:mod:`~..comm.simclock`).
"""
from __future__ import annotations

import threading
from collections import Counter

from ..comm import simclock


class AsyncStats:
    """Counters of one worker since the last evaluation (thread safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.clock = simclock.clock()
        self.total_steps = 0  # gradient steps of the whole run (not reset)
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.staleness: Counter = Counter()
            self.exchanges = 0
            self.idle_s = 0.0
            self.grad_steps = 0
            self.t0 = self.clock()

    def add_step(self) -> None:
        with self._lock:
            self.grad_steps += 1
            self.total_steps += 1

    def add_staleness(self, s: int) -> None:
        with self._lock:
            self.staleness[int(s)] += 1

    def add_exchange(self) -> None:
        with self._lock:
            self.exchanges += 1

    def add_idle(self, s: float) -> None:
        with self._lock:
            self.idle_s += s

    def snapshot(self) -> dict:
        """Plain data (it travels to the other workers as JSON)."""
        with self._lock:
            wall = max(self.clock() - self.t0, 1e-9)
            return {"staleness": {str(k): v for k, v in self.staleness.items()}, "exchanges": self.exchanges,
                    "idle_s": self.idle_s, "grad_steps": self.grad_steps, "total_steps": self.total_steps,
                    "wall_s": wall}


def combine(parts: list[dict]) -> dict:
    """The record fields of an asynchronous algorithm from every worker's snapshot."""
    hist: Counter = Counter()
    for p in parts:
        hist.update({int(k): v for k, v in p["staleness"].items()})
    top = max(hist) if hist else -1
    wall = max(p["wall_s"] for p in parts)
    n = sum(hist.values())
    return {"staleness_hist": [hist.get(i, 0) for i in range(top + 1)],
            "staleness_mean": (sum(k * v for k, v in hist.items()) / n) if n else None,
            "idle_fraction": [round(p["idle_s"] / p["wall_s"], 4) for p in parts],
            "exchanges_per_s": round(sum(p["exchanges"] for p in parts) / wall, 3),
            "averaging_rate": [round(p["exchanges"] / p["grad_steps"], 4) if p["grad_steps"] else None
                               for p in parts],
            "worker_steps_per_s": [round(p["grad_steps"] / p["wall_s"], 3) for p in parts],
            "global_steps": sum(p.get("total_steps", 0) for p in parts)}
