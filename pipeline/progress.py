"""Progress shown to the user as whole lines: a tqdm bar when the output is a terminal, otherwise
one line per interval and one when the count completes (``simulate: 1500/6000 ev (25%), 98.0 ev/s``),
never the carriage-return fragments a progress bar leaves in a log or a pipe. Used on the driver:
by the simulation stage, and by the training stage for its workers' reports (``train/progress.py``).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional, TextIO

INTERVAL_S = 30.0           # a progress line at most this often when the output is not a terminal


class Display:
    """What the user sees: a tqdm bar on a terminal, else ``<prefix><desc>: n/total <unit>`` lines
    at most every ``interval_s`` (and when a count completes); other lines printed as they are."""

    def __init__(self, stream: Optional[TextIO] = None, interval_s: float = INTERVAL_S,
                 tty: Optional[bool] = None, prefix: str = "") -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = interval_s
        self.prefix = prefix
        self.lock = threading.Lock()
        self.bar = None
        self.desc, self.t0, self.n0, self.last, self.done = None, 0.0, 0, 0.0, False

    def progress(self, desc: str, n: int, total: int, unit: str = "it") -> None:
        with self.lock:
            now = time.monotonic()
            if desc != self.desc:
                self._close_bar()
                self.desc, self.t0, self.n0, self.last, self.done = desc, now, n, now, False
            if self.tty:
                self._draw(desc, n, total, unit)
            elif now - self.last >= self.interval_s or (n >= total and not self.done):
                rate = (n - self.n0) / (now - self.t0) if now > self.t0 else 0.0
                pct = f" ({100 * n / total:.0f}%)" if total and n < total else ""
                shown = "" if unit == desc else f" {unit}"
                print(f"{self.prefix}{desc}: {n}/{total}{shown}{pct}, {rate:.1f} {unit}/s", file=self.stream,
                      flush=True)
                self.last, self.done = now, n >= total

    def _draw(self, desc: str, n: int, total: int, unit: str) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=n, desc=f"{self.prefix}{desc}", unit=unit, file=self.stream,
                            leave=False, dynamic_ncols=True)
        self.bar.total = total
        self.bar.update(n - self.bar.n)

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def line(self, text: str) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)

    def close(self) -> None:
        with self.lock:
            self._close_bar()


class Bar:
    """A count shown by a :class:`Display`, used like tqdm (``n``, ``update``, ``close``)."""

    def __init__(self, total: int, desc: str, unit: str = "it", display: Optional[Display] = None) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.display = display or Display()
        self.display.progress(desc, 0, total, unit)

    def update(self, k: int = 1) -> None:
        self.n += k
        self.display.progress(self.desc, self.n, self.total, self.unit)

    def close(self) -> None:
        self.display.close()
