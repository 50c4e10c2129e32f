"""A per-file time limit: opening a ROOT file's metadata and reading one chunk end after
``file_timeout_s`` (a stuck server, a FIFO that never gets a writer, a pathological file)."""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Optional


class ReadTimeout(TimeoutError):
    """A file's open or a chunk's read took longer than ``file_timeout_s``."""


@contextlib.contextmanager
def read_deadline(seconds: Optional[float]):
    """Raise :class:`ReadTimeout` in the block once ``seconds`` have passed (SIGALRM timer).

    Spark's Python workers run the task function in their main thread, as the driver does; in
    another thread (where signals cannot be delivered) the block runs without a limit. A timer
    already running (an enclosing deadline) is restored afterwards with its remaining time."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _fire(signum, frame):
        raise ReadTimeout(f"read timed out after {seconds:g} s")

    t0 = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _fire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 1e-3))
