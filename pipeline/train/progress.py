"""Training progress reaches the user as whole lines, shown by the driver.

A worker's progress bar, forwarded by a launcher, arrives as carriage-return fragments (Horovod
prefixes every fragment with ``[0]<stderr>:``). So workers draw nothing: rank 0 reports its step
counts (:func:`bar`) and its validation lines (:func:`emit`) to the driver over a small TCP line
channel whose address, with a per-run token, travels in the environment variable ``PIPELINE_PROGRESS``
(set by :func:`relay` around a launch; Horovod and local processes inherit it). The driver shows
one progress bar for the run when its output is a terminal, otherwise one line per interval; the
workers' lines are printed whole as they come.

A worker without the channel (TorchDistributor's processes on executors started before the run)
shows the same whole lines itself.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional, TextIO

ENV = "PIPELINE_PROGRESS"
INTERVAL_S = 30.0           # a progress line at most this often when the output is not a terminal
_SEND_EVERY_S = 0.5         # a worker reports its count at most this often (and at the end of a bar)


class Display:
    """What the user sees: a tqdm bar on a terminal, else ``[train] <desc>: n/total steps`` lines
    at most every ``interval_s`` (and when a bar completes); other lines printed as they are."""

    def __init__(self, stream: Optional[TextIO] = None, interval_s: float = INTERVAL_S,
                 tty: Optional[bool] = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.bar = None
        self.desc, self.t0, self.n0, self.last, self.done = None, 0.0, 0, 0.0, False

    def progress(self, desc: str, n: int, total: int) -> None:
        with self.lock:
            now = time.monotonic()
            if desc != self.desc:
                self._close_bar()
                self.desc, self.t0, self.n0, self.last, self.done = desc, now, n, now, False
            if self.tty:
                self._draw(desc, n, total)
            elif now - self.last >= self.interval_s or (n >= total and not self.done):
                unit = " rounds" if desc == "rounds" else " steps"
                rate = (n - self.n0) / (now - self.t0) if now > self.t0 else 0.0
                pct = f" ({100 * n / total:.0f}%)" if total and n < total else ""
                print(f"[train] {desc}: {n}/{total}{'' if desc == 'rounds' else unit}{pct}, {rate:.1f}{unit}/s",
                      file=self.stream, flush=True)
                self.last, self.done = now, n >= total

    def _draw(self, desc: str, n: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=n, desc=desc, file=self.stream, leave=False, dynamic_ncols=True)
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


# ---------------------------------------------------------------------------- the driver
@contextmanager
def relay(enabled: bool, host: str = "127.0.0.1", stream: Optional[TextIO] = None,
          interval_s: float = INTERVAL_S) -> Iterator[dict]:
    """Show the workers' progress on the driver for the duration of the block. Yields the
    environment a worker needs (also set in ``os.environ`` inside the block, for the launchers that
    copy it); empty when disabled or when no socket can be opened on ``host``."""
    if not enabled:
        yield {}
        return
    try:
        server = socket.create_server((host, 0))
    except OSError:
        yield {}
        return
    token = secrets.token_hex(16)
    env = {ENV: f"{host}:{server.getsockname()[1]}:{token}"}
    display = Display(stream, interval_s)
    before = os.environ.get(ENV)
    os.environ.update(env)
    threading.Thread(target=_accept, args=(server, token, display), name="progress-relay", daemon=True).start()
    try:
        yield env
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        time.sleep(0.1)           # the last lines of a worker that just finished
        server.close()
        display.close()


def worker_env() -> dict:
    """The progress channel of the run in progress (``{PIPELINE_PROGRESS: ...}``), for a launcher
    that starts workers with an environment of their own (Horovod's tasks); empty outside a relay."""
    return {ENV: os.environ[ENV]} if os.environ.get(ENV) else {}


def _accept(server: socket.socket, token: str, display: Display) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:           # closed at the end of the run
            return
        threading.Thread(target=_serve, args=(conn, token, display), daemon=True).start()


def _serve(conn: socket.socket, token: str, display: Display) -> None:
    with conn, conn.makefile("r", encoding="utf-8", errors="replace") as f:
        try:
            if json.loads(f.readline() or "{}").get("token") != token:
                return
            for raw in f:
                msg = json.loads(raw)
                if "line" in msg:
                    display.line(str(msg["line"]))
                else:
                    display.progress(str(msg["desc"]), int(msg["n"]), int(msg["total"]))
        except (OSError, ValueError, KeyError):
            return


# ---------------------------------------------------------------------------- a worker
class _Sink:
    """Where a worker's reports go: the driver's relay when ``PIPELINE_PROGRESS`` names one, else
    a local :class:`Display` on stderr."""

    def __init__(self) -> None:
        self.sock: Optional[socket.socket] = None
        self.local: Optional[Display] = None
        addr = os.environ.get(ENV, "")
        if addr.count(":") >= 2:
            host, port, token = addr.rsplit(":", 2)
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=10)
                self._send({"token": token})
            except (OSError, ValueError):
                self.sock = None
        if self.sock is None:
            self.local = Display()

    def _send(self, msg: dict) -> None:
        try:
            self.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            self.sock, self.local = None, Display()

    def progress(self, desc: str, n: int, total: int) -> None:
        if self.sock is not None:
            self._send({"desc": desc, "n": n, "total": total})
        if self.local is not None:
            self.local.progress(desc, n, total)

    def line(self, text: str) -> None:
        if self.sock is not None:
            self._send({"line": text})
        if self.local is not None:
            self.local.line(text)


_SINK: dict = {}


def _sink() -> _Sink:
    """One sink per process and channel (a relaunch after a lost worker gets a new channel)."""
    key = os.environ.get(ENV, "")
    if _SINK.get("key") != key or "sink" not in _SINK:
        old = _SINK.get("sink")
        if old is not None and old.sock is not None:
            old.sock.close()
        _SINK.update(key=key, sink=_Sink())
    return _SINK["sink"]


class _Bar:
    def __init__(self, total: int, initial: int, desc: str) -> None:
        self.total, self.n, self.desc, self.sent = total, initial, desc, 0.0
        _sink().progress(desc, initial, total)

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.monotonic()
        if now - self.sent >= _SEND_EVERY_S or self.n >= self.total:
            self.sent = now
            _sink().progress(self.desc, self.n, self.total)

    def close(self) -> None:
        if self.n < self.total:
            _sink().progress(self.desc, self.n, self.total)


class _NoBar:
    def update(self, k: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, initial: int, desc: str, enabled: bool):
    """A worker's progress over ``total`` steps (``update``/``close`` like tqdm), reported to the
    driver; a no-op when not ``enabled`` (ranks other than 0, ``progress: false``)."""
    return _Bar(total, initial, desc) if enabled else _NoBar()


def emit(text: str) -> None:
    """One whole line from rank 0 (a validation result), shown by the driver."""
    _sink().line(text)
