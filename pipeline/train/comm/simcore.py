"""The scheduler of the simulated clock (:mod:`.simclock`): one :class:`Simulation` runs its threads
one at a time in virtual time, the thread due first next, ties broken by the simulation's seeded
generator; :func:`current` is the simulation of the calling thread. The primitives the algorithms
use (locks, events, threads, ...) and the compute-time model's step are in :mod:`.simclock`.

A run is ended from outside (:meth:`Simulation.end`: a stall, a timeout, the launcher giving up):
from then on every wait of its threads raises :class:`RunEnded`, so each thread unwinds, one at a
time as before. A thread that holds the baton and never waits again (blocked outside the
simulation) is the caller's to interrupt; :meth:`Simulation.release` then lets the parked threads
unwind without it. :meth:`Simulation.run` with a ``timeout_s`` ends the run that way before it raises,
so no thread of it outlives the call (:meth:`Simulation.alive` names any that did).
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import threading
from typing import Callable, Optional

import numpy as np

from .costmodel import FlatCost, Ledger

_tls = threading.local()
#: timer wake-ups in a row with no other event after which the waiting threads are deadlocked
POLL_LIMIT = 20000


class SimDeadlock(RuntimeError):
    """Every thread of a simulated run waits for another: nothing can happen any more."""


class RunEnded(RuntimeError):
    """The run this thread belongs to was ended from outside (:meth:`Simulation.end`): it unwinds."""


class _Task:
    """One simulated thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.go = threading.Event()     # the baton, natively
        self.ticket = 0                 # invalidates stale entries of the ready heap
        self.paused = False             # waiting (on a timer or for a wake)
        self.woken = False
        self.what = ""                  # what it waits for (deadlock messages)
        self.progress = False           # its timer is work, not a poll
        self.error: Optional[BaseException] = None
        self.finished = False
        self.joiners: list[_Task] = []
        self.thread: Optional[threading.Thread] = None


class Simulation:
    """The scheduler of one simulated run (see module docstring)."""

    def __init__(self, cfg, seed: int = 0, cost=None) -> None:
        """``cfg``: step_s, step_jitter, latency_s, bytes_per_s and seed (``stragglers.SimClockConfig``);
        ``cost``: what collectives and messages cost (a :class:`~.costmodel.Cluster`; default the flat
        ``latency_s + bytes / bytes_per_s`` of ``cfg``)."""
        self.cfg = cfg
        self.cost = cost if cost is not None else FlatCost(cfg.latency_s, cfg.bytes_per_s)
        self.ledger = Ledger()      # compute and communication seconds per rank, bytes per link
        self.seed = int(cfg.seed if cfg.seed is not None else seed)
        self.now = 0.0
        self._rng = np.random.default_rng([self.seed & 0xFFFFFFFF, 0x51C])
        self._ready: list = []
        self._seq = itertools.count()
        self.tasks: list[_Task] = []
        self.current: Optional[_Task] = None
        self._finished = threading.Event()
        self._idle_polls = 0
        self.switches = 0
        self._trace = hashlib.sha1()
        self._step_rngs: dict[int, np.random.Generator] = {}
        self.failure: Optional[BaseException] = None
        self.ended: Optional[str] = None     # why the run was ended from outside (end())
        self._released = False              # release(): the parked threads unwind on their own

    # ------------------------------------------------------------------ the clock and the model
    def clock(self) -> float:
        return self.now

    def step_seconds(self, rank: int) -> float:
        """The virtual compute time of ``rank``'s next step (before the straggler factor)."""
        rng = self._step_rngs.get(rank)
        if rng is None:
            rng = self._step_rngs[rank] = np.random.default_rng([self.seed & 0xFFFFFFFF, int(rank)])
        j = self.cfg.step_jitter
        return self.cfg.step_s * float(rng.uniform(1.0 - j, 1.0 + j))

    def transfer_seconds(self, nbytes: int) -> float:
        return self.cfg.latency_s + float(nbytes) / self.cfg.bytes_per_s

    def summary(self) -> dict:
        """Plain data: virtual seconds, thread switches, a digest of the order the threads ran in, the
        share of the ranks' time spent communicating and the bytes that crossed each link."""
        led = self.ledger.summary(self.now)
        return {"virtual_s": round(self.now, 6), "switches": self.switches, "trace": self._trace.hexdigest(),
                "comm_share": led["comm_share"], "bytes_per_link": led["bytes_per_link"]}

    # ------------------------------------------------------------------ threads
    def spawn(self, fn: Callable, args: tuple = (), name: str = "sim") -> _Task:
        """A new simulated thread, runnable now (called by the running thread, or before :meth:`run`)."""
        t = _Task(name)
        self.tasks.append(t)
        self._push(t, self.now)
        t.thread = threading.Thread(target=self._main, args=(t, fn, args), daemon=True, name=name)
        t.thread.start()
        return t

    def start(self) -> None:
        """Hand the baton to the first thread (called once, by a thread outside the simulation)."""
        nxt = self._next()
        if nxt is None:
            self._finished.set()
        else:
            self._resume(nxt)

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Wait (wall clock) until every thread of the run has ended; False when ``timeout_s`` passed first."""
        return self._finished.wait(timeout_s)

    def run(self, timeout_s: Optional[float] = None, grace_s: float = 5.0) -> None:
        """Run the spawned threads to their end (called by a thread outside the simulation). After
        ``timeout_s`` seconds of wall clock the run is ended (:meth:`end`), its threads get ``grace_s``
        to unwind (then the parked ones are released), and TimeoutError is raised."""
        self.start()
        if not self.wait(timeout_s):
            self.end(f"the simulated run did not end within {timeout_s:g} s of wall clock")
            if not self.wait(grace_s):
                self.release()
                self.wait(grace_s)
            left = self.alive()
            raise TimeoutError(f"the simulated run did not end within {timeout_s:g} s of wall clock" +
                               (f"; threads still running: {', '.join(left)}" if left else ""))

    def end(self, why: str) -> None:
        """End the run from outside: every wait of its threads raises :class:`RunEnded` (``why``)."""
        self.ended = self.ended or why

    def release(self) -> None:
        """After :meth:`end`, when the thread holding the baton does not return: let every parked
        thread unwind without it (they no longer take turns)."""
        self._released = True
        for t in list(self.tasks):
            if not t.finished and t is not self.current:
                t.error, t.woken = RunEnded(self.ended or "the run was ended"), True
                t.go.set()

    def alive(self) -> list[str]:
        """The names of the run's threads that are still running."""
        return [t.name for t in self.tasks if t.thread is not None and t.thread.is_alive()]

    def _main(self, t: _Task, fn: Callable, args: tuple) -> None:
        t.go.wait()
        t.go.clear()
        _tls.sim, _tls.task = self, t
        try:
            if t.error is not None:     # released before it ever ran
                raise t.error
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - a thread's own failure; the rank threads report theirs
            self.failure = self.failure or e
        finally:
            t.finished = True
            for j in t.joiners:
                self.wake(j)
            self._idle_polls = 0
            if self._released:      # the threads unwind on their own: no baton to pass
                if all(x.finished for x in self.tasks):
                    self._finished.set()
                return
            nxt = self._next()
            if nxt is None:
                self._finished.set()
            else:
                self._resume(nxt)

    def me(self) -> _Task:
        t = getattr(_tls, "task", None)
        if t is None or getattr(_tls, "sim", None) is not self:
            raise RuntimeError("a simulated primitive used outside its simulation's threads")
        return t

    # ------------------------------------------------------------------ scheduling
    def _push(self, t: _Task, due: float) -> None:
        t.ticket += 1
        heapq.heappush(self._ready, (max(due, self.now), float(self._rng.random()), next(self._seq), t.ticket, t))

    def _next(self) -> Optional[_Task]:
        if self.ended is not None:          # every waiting thread unwinds with RunEnded
            for t in self.tasks:
                if t.paused and not t.finished and t.error is None:
                    t.error, t.woken = RunEnded(self.ended), True
                    self._push(t, self.now)
        while True:
            while self._ready:
                due, _, _, ticket, t = heapq.heappop(self._ready)
                if ticket != t.ticket or t.finished:
                    continue
                if t.paused and not t.woken:      # its timer fired
                    if t.progress:
                        self._idle_polls = 0
                    else:
                        self._idle_polls += 1
                        if self._idle_polls > POLL_LIMIT:
                            self._deadlock("only polling timers fired for a long time")
                            continue
                self.now = max(self.now, due)
                t.paused = False
                self.switches += 1
                self._trace.update(f"{t.name}@{self.now:.9f};".encode())
                return t
            if not self._deadlock("every thread waits"):
                return None

    def _deadlock(self, why: str) -> bool:
        stuck = [t for t in self.tasks if not t.finished and t.paused]
        if not stuck:
            return False
        waits = "; ".join(f"{t.name}: {t.what}" for t in stuck)
        for t in stuck:
            t.error = SimDeadlock(f"simulated run deadlocked at {self.now:.3f} virtual s ({why}): {waits}")
            t.woken = True
            self._push(t, self.now)
        self._idle_polls = 0
        return True

    def _resume(self, t: _Task) -> None:
        self.current = t
        t.go.set()

    def pause(self, until: Optional[float], what: str = "", progress: bool = False) -> bool:
        """The running thread waits: for :meth:`wake`, or until virtual time ``until`` (None: no timer).
        Returns True when woken, False when the timer fired. ``progress``: the timer is work (a step's
        compute time, a message in transit), not a poll."""
        me = self.me()
        if self.ended is not None:
            raise RunEnded(self.ended)
        me.paused, me.woken, me.what, me.progress = True, False, what, progress
        me.ticket += 1
        if until is not None:
            self._push(me, until)
        nxt = self._next()
        if nxt is not me:
            if nxt is None:
                raise SimDeadlock(f"simulated run: {me.name} waits for {what} and no thread can run")
            self._resume(nxt)
            me.go.wait()
            me.go.clear()
        self.current = me
        if me.error is not None:
            e, me.error = me.error, None
            raise e
        return me.woken

    def wake(self, t: _Task) -> None:
        """Make a waiting thread runnable now."""
        if t.paused and not t.woken and not t.finished:
            t.woken = True
            self._idle_polls = 0
            self._push(t, self.now)

    def sleep(self, seconds: float) -> None:
        self.pause(self.now + max(0.0, float(seconds)), "sleeping", progress=True)


def current() -> Optional[Simulation]:
    """The simulation of the calling thread, None outside one."""
    return getattr(_tls, "sim", None)
