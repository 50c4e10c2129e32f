"""What a stage's driver holds while it runs, for the driver-memory tests: the peak of Python's
own allocations (``tracemalloc``) and the peak of pyarrow's default memory pool above its level
at the start. tracemalloc does not see pyarrow's allocations (Arrow buffers come from jemalloc or
mimalloc, not from Python's allocator), so a driver that read the per-event or per-row arrays into
Arrow tables (``toArrow``, a Parquet or IPC read) would pass a tracemalloc-only test.

The pool's peak: its current bytes sampled every 0.5 ms on a thread (pyarrow releases the GIL
while it reads, so the sampler runs), and the pool's own ``max_memory()`` where the run pushed it
above every earlier peak (then it is the run's exact peak, whatever the sampler missed).
"""
from __future__ import annotations

import threading
import time
import tracemalloc

import pyarrow as pa


class DriverMemory:
    """``with DriverMemory() as m: ...``; then ``m.python`` and ``m.arrow`` (peak bytes)."""

    def __init__(self, every_s: float = 0.0005):
        self.every_s = every_s
        self.python = 0
        self.arrow = 0

    def __enter__(self) -> "DriverMemory":
        pool = pa.default_memory_pool()
        self._pool, self._base, self._max0 = pool, pool.bytes_allocated(), pool.max_memory()
        self._peak = self._base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="driver-memory", daemon=True)
        self._thread.start()
        tracemalloc.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._pool.bytes_allocated())
            time.sleep(self.every_s)

    def __exit__(self, *exc) -> None:
        self.python = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        self._stop.set()
        self._thread.join()
        peak = max(self._peak, self._pool.bytes_allocated())
        if self._pool.max_memory() > self._max0:       # a new high-water mark: the run's exact peak
            peak = max(peak, self._pool.max_memory())
        self.arrow = peak - self._base
