"""A worker process that stops making progress ends itself instead of hanging the launch.

Horovod-on-Spark and TorchDistributor wait for every worker process to exit. When a peer dies
mid-collective the survivors usually fail at once, but a survivor can also block for good (in a
collective whose peer is gone, or in its cleanup). Then the launch never returns and the restart
policy (``restart.supervise``) never runs.

:class:`Watchdog` runs in every dedicated worker process (not in the driver):

* the worker calls :meth:`Watchdog.beat` after each completed step, evaluation and checkpoint;
* when no beat came for ``stall_timeout`` seconds (``TrainConfig.stall_timeout``), the process
  prints one line naming the rank and the stall, the stacks of all its threads (stderr), and
  exits with status :data:`EXIT_CODE`; the launcher sees a failed worker and the run is relaunched
  from the newest complete checkpoint;
* after a failure, :meth:`failing` gives the worker's cleanup (closing readers, shutting the
  communicator down, interpreter exit) :data:`CLEANUP_GRACE_S` seconds before it is ended the
  same way;
* the watch is a Python thread; a C-level ``faulthandler`` timer :data:`BACKSTOP_S` seconds later
  ends the process even when that thread cannot run (a call holding the GIL).

``stall_timeout = 0`` turns the watch off.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Optional

#: exit status of a worker ended by the watchdog (EX_TEMPFAIL: a relaunch may succeed)
EXIT_CODE = 75
#: seconds the cleanup after a failure may take before the process is ended
CLEANUP_GRACE_S = 30.0
#: extra seconds before the C-level backstop ends a process whose watch thread cannot run
BACKSTOP_S = 30.0


class Watchdog:
    """See module docstring. ``timeout_s`` <= 0: no watch (``beat``/``failing``/``stop`` do nothing)."""

    def __init__(self, timeout_s: float, rank: int, poll_s: Optional[float] = None,
                 backstop_s: float = BACKSTOP_S) -> None:
        self.timeout = float(timeout_s or 0)
        self.rank = rank
        self.backstop_s = backstop_s
        self._grace = CLEANUP_GRACE_S
        self._last = time.monotonic()
        self._deadline: Optional[float] = None  # set by failing(): the cleanup's deadline
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self.timeout > 0:
            self._poll = poll_s if poll_s is not None else min(5.0, self.timeout / 4)
            self._arm_backstop(self.timeout)
            self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def beat(self) -> None:
        """The worker made progress (a step, an evaluation, a checkpoint)."""
        self._last = time.monotonic()

    def failing(self, grace_s: float = CLEANUP_GRACE_S) -> None:
        """The worker failed: its cleanup and exit must end within ``grace_s`` seconds."""
        if self.active:
            self._grace = grace_s
            self._deadline = time.monotonic() + grace_s
            self._arm_backstop(grace_s)

    def stop(self) -> None:
        """The worker finished normally: no more watching."""
        if self._thread is not None and not self._stop.is_set():
            self._stop.set()
            faulthandler.cancel_dump_traceback_later()

    # ------------------------------------------------------------------ internals
    def _arm_backstop(self, seconds: float) -> None:
        faulthandler.dump_traceback_later(seconds + self.backstop_s, exit=True, file=sys.__stderr__)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            now = time.monotonic()
            if self._deadline is not None:
                if now >= self._deadline:
                    self._end(f"its cleanup after a failure did not finish within {self._grace:g} s")
                continue
            idle = now - self._last
            if idle >= self.timeout:
                self._end(f"no step, evaluation or checkpoint completed for {idle:.0f} s "
                          f"(stall_timeout={self.timeout:g})")
            self._arm_backstop(self.timeout - idle)

    def _end(self, why: str) -> None:
        if self._stop.is_set():
            return
        err = sys.__stderr__
        print(f"rank {self.rank}: worker stalled: {why}; ending this process (exit {EXIT_CODE}) so the launch "
              f"fails and is relaunched from the newest checkpoint; its threads' stacks follow", file=err, flush=True)
        try:
            faulthandler.dump_traceback(file=err, all_threads=True)
        finally:
            os._exit(EXIT_CODE)
