"""The serving side of an asynchronous exchange: one thread per client, with round gating.

Each thread blocks on a receive from its client (its own pair group, :mod:`.p2p`) and calls
``handle(src, kind)`` for every request; END closes the client's round r, after which the
thread waits until the main thread begins round r + 1 (so nothing is served while the main
thread is in a collective or changes what the handlers serve); LEAVE retires the client.
``leave()`` switches gating off: the threads serve until every client has left.

Waiting for the clients' END has no time bound while they are alive (:mod:`.liveness`); a dead
client fails the wait at once (its connection closed) or after its heartbeat went silent.
``opened``, when set, is called by the main thread right after a round's gate opened (an
instrumentation point: a test holds the gate there to drive a waiting request into it).
"""
from __future__ import annotations

from typing import Callable, Optional

from . import simclock
from .liveness import wait_until
from .p2p import END, LEAVE, PeerError


class RoundServer:
    """Serving threads for ``clients`` on ``channel`` (see module docstring)."""

    def __init__(self, channel, clients, handle: Callable[[int, int], None], name: str) -> None:
        self.ch, self.clients, self.handle = channel, list(clients), handle
        self.cv = simclock.condition()
        self.clock = simclock.clock()
        self.begun = -1
        self.ended = {c: -1 for c in self.clients}
        self.left: set[int] = set()
        self.leaving = False
        self.error: Optional[BaseException] = None
        self.opened: Optional[Callable[[int], None]] = None
        self.threads = [simclock.thread(self._serve, (c,), name=f"{name}-{c}") for c in self.clients]
        for t in self.threads:
            t.start()

    def _serve(self, src: int) -> None:
        r = 0
        try:
            while True:
                with self.cv:
                    self.cv.wait_for(lambda: self.begun >= r or self.leaving or self.error is not None)
                    if self.error is not None:
                        return
                while True:
                    kind = self.ch.recv_header(src)[0]
                    if kind == END:
                        with self.cv:
                            self.ended[src] = r
                            self.cv.notify_all()
                        r += 1
                        break
                    if kind == LEAVE:
                        with self.cv:
                            self.left.add(src)
                            self.cv.notify_all()
                        return
                    self.handle(src, kind)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            with self.cv:
                self.error = self.error or e
                self.cv.notify_all()

    def check(self) -> None:
        if self.error is not None:
            e = self.error
            raise (e if isinstance(e, PeerError) else PeerError(str(e))) from e

    def begin_round(self, r: int) -> None:
        self.check()
        with self.cv:
            self.begun = r
            self.cv.notify_all()
        if self.opened is not None:
            self.opened(r)

    def _missing(self, r: int) -> list[int]:
        return [c for c in self.clients if self.ended[c] < r and c not in self.left]

    def end_round(self, r: int, liveness=None, keepalive=None) -> None:
        """Wait until every client ended round ``r`` (or left): no bound while they are alive."""
        def over(timeout: float) -> bool:
            with self.cv:
                return self.cv.wait_for(lambda: self.error is not None or not self._missing(r), timeout)

        wait_until(over, liveness, lambda: self._missing(r), f"round {r}: waiting for the clients' END", keepalive)
        self.check()

    def leave(self, timeout_s: Optional[float]) -> None:
        """Serve until every client left, at most ``timeout_s`` (this worker is done: a client that
        does not leave by then has failed)."""
        with self.cv:
            self.leaving = True
            self.cv.notify_all()
        deadline = None if timeout_s is None else self.clock() + timeout_s
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - self.clock()))
        self.check()
        if any(t.is_alive() for t in self.threads):
            raise PeerError(f"rank {self.ch.rank}: clients {sorted(set(self.clients) - self.left)} did not leave "
                            f"within {timeout_s:.0f} s")
