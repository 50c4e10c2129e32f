"""Liveness of the peers of an asynchronous run: heartbeats, separate from how slow a peer is.

Every rank's heartbeat thread writes its own key in the rendezvous store (torch.distributed's
key-value store, a connection of its own, keys under ``pipeline/liveness/``) every ``period_s``:
``beat/<rank>`` holds two counters, its heartbeats (it is alive) and the gradient steps it took
(:meth:`Liveness.note_progress`), signed with the run's secret (:func:`.rendezvous.signed`). The
same thread reads the keys of the ranks it watches and notes, on this machine's clock, when each
counter last changed. So:

* a peer whose heartbeat has not changed for ``dead_after_s`` (``algorithm.params.timeout_s``)
  is dead, frozen or unreachable: :meth:`Liveness.check` raises a :class:`~.p2p.PeerError`
  naming it, and leaves that verdict in the store for the others' error messages
  (:meth:`Liveness.explain`);
* a peer whose heartbeat goes on is waited for without a bound, however slow it is;
  :func:`wait_until` keeps the waiting worker's own watchdog quiet (``keepalive``) while a
  peer it waits for makes progress (so a straggler is not mistaken for a stall, while two
  workers that wait for each other still are).

A peer that dies closes its connections, which fails a pending receive at once; the
heartbeats catch what does not close a connection (a frozen process, a lost machine).

Anyone who reaches the store's port can write its keys. A value that is not signed for its key with
the run's secret (forged, copied from another rank's key, another run's), or whose counters go
backwards (replayed), is not a silent peer: :meth:`Liveness.check` raises a
:class:`StoreValueError` naming the key, and :meth:`Liveness.explain` gives that line, never the
value's text.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable, Optional, Sequence

from .p2p import PeerError
from .rendezvous import StoreValueError, signed, verified

PREFIX = "pipeline/liveness"     # torch's PrefixStore joins it and a key with "/"
VERDICT = "verdict"


def store_key(name: str) -> str:
    """The full key in the store of the liveness key ``name`` (what a signature covers)."""
    return f"{PREFIX}/{name}"


def store_client(dead_after_s: float):
    """A connection of its own to the run's rendezvous store (``MASTER_ADDR``:``MASTER_PORT``)."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, None, False, timedelta(seconds=max(10.0, 2 * dead_after_s)),
                          wait_for_workers=False)
    return dist.PrefixStore(PREFIX, store)


class StoreTampered(PeerError):
    """A key of the liveness store holds a value this run's ranks did not write (one line naming it)."""


class Liveness:
    """Heartbeats of this rank and of the ranks it watches (see module docstring); ``secret`` is the
    run's secret (:func:`.rendezvous.run_secret`)."""

    def __init__(self, store, rank: int, dead_after_s: float, *, secret: bytes) -> None:
        self.store, self.rank = store, int(rank)
        self._secret = bytes(secret)
        self._beats = 0
        self._fault: Optional[str] = None        # the first value refused (a line naming its key)
        self.dead_after_s = float(dead_after_s)
        self.period_s = min(2.0, max(0.05, self.dead_after_s / 8))
        self._lock = threading.Lock()
        self._seen: dict[int, list] = {}   # rank -> [beats, steps, t_beat, t_step] (monotonic clock)
        self._steps = 0
        self._verdict_out: Optional[str] = None   # to leave in the store (by the heartbeat thread)
        self._verdict_in: Optional[str] = None    # a verdict some rank left there
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"heartbeat-{rank}")
        self._thread.start()

    # -- this rank
    def note_progress(self) -> None:
        """One gradient step of this rank (published with the next heartbeat)."""
        self._steps += 1

    def watch(self, ranks: Iterable[int]) -> None:
        now = time.monotonic()
        with self._lock:
            for r in ranks:
                if int(r) != self.rank:
                    self._seen.setdefault(int(r), [-1, -1, now, now])

    def _run(self) -> None:
        """The only thread that talks to the store: a store that hangs (its host frozen) stalls this
        thread, never the training thread, and the peers' heartbeats then go silent."""
        while not self._stop.is_set():
            try:
                self._beat()
            except StoreValueError as e:   # a value we did not write: an error naming the key, not a silence
                if self._fault is None:
                    self._fault = str(e)
            except Exception:  # noqa: BLE001 - the store is gone: the peers' heartbeats go silent
                pass
            self._stop.wait(self.period_s)

    def _beat(self) -> None:
        self._beats += 1
        mine = f"beat/{self.rank}"
        self.store.set(mine, signed(self._secret, store_key(mine), f"{self._beats} {self._steps}"))
        if self._verdict_out is not None:
            self.store.set(VERDICT, signed(self._secret, store_key(VERDICT), self._verdict_out))
            self._verdict_out = None
        with self._lock:
            ranks = list(self._seen)
        for r in ranks:
            name = f"beat/{r}"
            if not self.store.check([name]):
                continue                           # it has not beaten yet
            beats, done = self._counters(name, self.store.get(name))
            now = time.monotonic()
            with self._lock:
                rec = self._seen[r]
                if beats < rec[0] or done < rec[1]:
                    raise StoreValueError(f"rendezvous store key {store_key(name)!r}: its counters went back "
                                          f"from {rec[0]} {rec[1]} to {beats} {done} (an old value written again)")
                if beats != rec[0]:
                    rec[0], rec[2] = beats, now
                if done != rec[1]:
                    rec[1], rec[3] = done, now
        if self._verdict_in is None and self.store.check([VERDICT]):
            self._verdict_in = verified(self._secret, store_key(VERDICT), self.store.get(VERDICT))

    def _counters(self, name: str, value: bytes) -> tuple[int, int]:
        payload = verified(self._secret, store_key(name), value)
        try:
            beats, done = (int(x) for x in payload.split(" "))
        except ValueError:
            raise StoreValueError(f"rendezvous store key {store_key(name)!r}: a signed value that is not two "
                                  "counters") from None
        return beats, done

    # -- the peers
    def silent(self, ranks: Sequence[int]) -> list[tuple[int, float]]:
        """(rank, seconds) of the watched ``ranks`` whose heartbeat has been silent for over ``dead_after_s``."""
        now = time.monotonic()
        with self._lock:
            return [(r, now - self._seen[r][2]) for r in ranks
                    if r in self._seen and now - self._seen[r][2] > self.dead_after_s]

    def check(self, ranks: Sequence[int], what: str) -> None:
        """Raise PeerError (and leave the verdict in the store) when one of ``ranks`` is silent;
        StoreTampered when a value read from the store was refused."""
        if self._fault is not None:
            raise StoreTampered(f"rank {self.rank}: {what}: {self._fault}")
        dead = self.silent(ranks)
        if not dead:
            return
        verdict = "; ".join(f"rank {r} sent no heartbeat for {s:.1f} s (dead, frozen or unreachable)"
                            for r, s in dead)
        self._verdict_out = f"rank {self.rank} found: {verdict}"
        raise PeerError(f"rank {self.rank}: {what}: {verdict}")

    def progress_marks(self, ranks: Sequence[int]) -> float:
        """When one of ``ranks`` last took a step (monotonic clock)."""
        with self._lock:
            return max((self._seen[r][3] for r in ranks if r in self._seen), default=0.0)

    def explain(self) -> Optional[str]:
        """Why the run is failing, as far as the heartbeats tell: the verdict a rank left in the
        store, else the watched ranks that are silent now; None when every heartbeat goes on.
        Reads only what the heartbeat thread fetched (never blocks on the store)."""
        if self._fault is not None:
            return self._fault
        if self._verdict_in is not None:
            return self._verdict_in
        with self._lock:
            watched = list(self._seen)
        dead = self.silent(watched)
        if dead:
            return "; ".join(f"rank {r} sent no heartbeat for {s:.1f} s" for r, s in dead)
        return None

    def stop(self) -> None:
        self._stop.set()


def wait_until(done: Callable[[float], bool], liveness: Optional[Liveness], peers, what: str,
               keepalive: Optional[Callable[[], None]] = None) -> None:
    """Wait until ``done(timeout_s)`` is true, without a bound while the ``peers`` (a list, or a
    callable giving the ranks waited for now) are alive; PeerError as soon as one is silent.
    ``keepalive`` is called whenever one of them made progress since the last look. Without
    ``liveness`` (one process: nothing to tell a dead peer from a slow one) ``done`` waits unbounded."""
    poll = liveness.period_s if liveness is not None else None
    mark = time.monotonic()
    while not done(poll):
        if liveness is None:
            continue
        ranks = peers() if callable(peers) else peers
        liveness.check(ranks, what)
        if keepalive is not None:
            last = liveness.progress_marks(ranks)
            if last > mark:
                mark = last
                keepalive()
