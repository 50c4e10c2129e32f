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

import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional, TextIO

from ..progress import INTERVAL_S, Display

log = logging.getLogger(__name__)

ENV = "PIPELINE_PROGRESS"
_SEND_EVERY_S = 0.5         # a worker reports its count at most this often (and at the end of a bar)


# ---------------------------------------------------------------------------- the driver
#: the relay listens on ``spark.driver.host``, which the whole cluster network reaches. So, before a
#: connection proved it holds the run's token, the relay reads no more than the greeting's length and
#: waits for it at most this long; a token holder's line may be at most MAX_LINE bytes; and one
#: thread serves every connection, at most MAX_PENDING of them unproven at a time.
HELLO_TIMEOUT_S = 2.0
MAX_LINE = 64 << 10
MAX_PENDING = 32
MAX_SERVED = 8


def greeting(token: str) -> bytes:
    """What a worker sends first: the run's token, as one JSON line."""
    return (json.dumps({"token": token}) + "\n").encode()


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
    display = Display(stream, interval_s, prefix="[train] ")
    before = os.environ.get(ENV)
    os.environ.update(env)
    stop = threading.Event()
    loop = threading.Thread(target=_serve, args=(server, greeting(token), display, stop), name="progress-relay",
                            daemon=True)
    loop.start()
    try:
        yield env
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        time.sleep(0.1)           # the last lines of a worker that just finished
        stop.set()
        loop.join(5)
        server.close()
        display.close()


def _unit(desc: str) -> str:
    return "rounds" if desc == "rounds" else "steps"


def worker_env() -> dict:
    """The progress channel of the run in progress (``{PIPELINE_PROGRESS: ...}``), for a launcher
    that starts workers with an environment of their own (Horovod's tasks); empty outside a relay."""
    return {ENV: os.environ[ENV]} if os.environ.get(ENV) else {}


class _Conn:
    """One connection: unproven (reading the greeting, with a deadline) or serving lines."""

    def __init__(self, sock: socket.socket, peer) -> None:
        self.sock, self.peer = sock, peer
        self.buf = bytearray()
        self.proven = False
        self.deadline = time.monotonic() + HELLO_TIMEOUT_S


def _serve(server: socket.socket, hello: bytes, display: Display, stop: threading.Event) -> None:
    """The relay's one thread: accept, check each connection's greeting first, then show its lines."""
    sel = selectors.DefaultSelector()
    server.setblocking(False)
    sel.register(server, selectors.EVENT_READ, None)
    conns: dict[socket.socket, _Conn] = {}

    def drop(c: _Conn) -> None:
        sel.unregister(c.sock)
        conns.pop(c.sock, None)
        c.sock.close()

    try:
        while not stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                if key.data is None:
                    _accept(server, sel, conns)
                elif not _read(key.data, hello, display):
                    drop(key.data)
            now = time.monotonic()
            for c in [c for c in conns.values() if not c.proven and now > c.deadline]:
                drop(c)
    finally:
        for c in list(conns.values()):
            drop(c)
        sel.close()


def _accept(server: socket.socket, sel, conns: dict) -> None:
    try:
        sock, peer = server.accept()
    except (BlockingIOError, InterruptedError):
        return
    except OSError:               # closed at the end of the run
        return
    pending = sum(1 for c in conns.values() if not c.proven)
    served = len(conns) - pending
    if pending >= MAX_PENDING or served >= MAX_SERVED:
        sock.close()              # refused: no thread, no buffer
        return
    sock.setblocking(False)
    c = _Conn(sock, peer)
    conns[sock] = c
    sel.register(sock, selectors.EVENT_READ, c)


def _read(c: _Conn, hello: bytes, display: Display) -> bool:
    """Read what ``c`` sent; False when it is to be closed (end, wrong token, oversize or bad line)."""
    want = len(hello) - len(c.buf) if not c.proven else MAX_LINE + 1 - len(c.buf)
    try:
        data = c.sock.recv(max(1, min(want, 1 << 16)))
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    if not data:
        return False
    c.buf += data
    if not c.proven:              # the token first, on exactly the greeting's length
        if len(c.buf) < len(hello):
            return True
        if not hmac.compare_digest(bytes(c.buf), hello):
            return False
        c.proven, c.buf = True, bytearray()
        return True
    *lines, rest = c.buf.split(b"\n")
    if len(rest) > MAX_LINE:
        log.warning("progress relay: a line of over %d bytes from %s:%s refused; its connection is closed",
                    MAX_LINE, *c.peer[:2])
        return False
    c.buf = bytearray(rest)
    try:
        for raw in lines:
            msg = json.loads(raw.decode("utf-8", errors="replace"))
            if "line" in msg:
                display.line(str(msg["line"]))
            else:
                display.progress(str(msg["desc"]), int(msg["n"]), int(msg["total"]), _unit(str(msg["desc"])))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


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
                self.sock.sendall(greeting(token))
            except (OSError, ValueError):
                self.sock = None
        if self.sock is None:
            self.local = Display(prefix="[train] ")

    def _send(self, msg: dict) -> None:
        try:
            self.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            self.sock, self.local = None, Display(prefix="[train] ")

    def progress(self, desc: str, n: int, total: int) -> None:
        if self.sock is not None:
            self._send({"desc": desc, "n": n, "total": total})
        if self.local is not None:
            self.local.progress(desc, n, total, _unit(desc))

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
