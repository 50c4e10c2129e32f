"""A deterministic simulated clock for the ranks of one process (the ``inprocess`` launcher's runs that
depend on time: asynchronous algorithms, time-budgeted rounds, stragglers).

The threads of a simulated run (every rank's training thread and the threads the algorithms start:
AD-PSGD's communication thread, the serving threads, a centre link's sending thread) are real
threads, but **exactly one runs at a time**: it holds the baton until it yields, and then the
thread due first in virtual time runs next. A thread yields when it

* computes a step (:func:`compute_step`: its compute time, from the per-worker model below),
* sleeps (:func:`sleep`), waits for a lock, a condition, an event, a future or a thread, or
* receives a message not yet delivered (:class:`SimChannel`: delivery after ``latency_s`` plus
  the bytes over ``bytes_per_s``).

Equal virtual times are broken by a key drawn from the simulation's seeded generator when the
thread became runnable. Nothing else decides the order, so the same seed gives the same run to the
bit; another seed, compute-time model, straggler factor or delay gives another interleaving.

The code of the algorithms is the code the real launchers run; what they take from this module is
their runtime: :func:`lock`, :func:`condition`, :func:`event`, :func:`thread`, :func:`future`,
:func:`queue`, :func:`clock` and :func:`sleep` give the real ``threading`` / ``time`` objects on a
thread outside a simulation and the simulated ones inside it (decided when the object is made, by
the thread that makes it).

The compute-time model (``pipeline.train.stragglers.SimClockConfig``, read by attribute): a step of worker r takes
``step_s * u * slowdown[r]`` virtual seconds, ``u`` uniform in ``[1 - step_jitter, 1 + step_jitter]``
drawn from ``default_rng([seed, rank])`` (one draw per step), plus the straggler simulator's random
delay (``pipeline.train.stragglers``). The forward and backward pass themselves take no virtual time.

A deadlock (every thread waiting, none on a timer, or only polling timers firing with nothing else
happening) fails every waiting thread with :class:`SimDeadlock` instead of hanging.
"""
from __future__ import annotations

import collections
import hashlib
import heapq
import itertools
import queue as queue_mod
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

import numpy as np

_tls = threading.local()
#: timer wake-ups in a row with no other event after which the waiting threads are deadlocked
POLL_LIMIT = 20000


class SimDeadlock(RuntimeError):
    """Every thread of a simulated run waits for another: nothing can happen any more."""


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


class Simulation:
    """The scheduler of one simulated run (see module docstring)."""

    def __init__(self, cfg, seed: int = 0) -> None:
        """``cfg``: step_s, step_jitter, latency_s, bytes_per_s and seed (``stragglers.SimClockConfig``)."""
        self.cfg = cfg
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
        """Plain data: virtual seconds, thread switches, a digest of the order the threads ran in."""
        return {"virtual_s": round(self.now, 6), "switches": self.switches, "trace": self._trace.hexdigest()}

    # ------------------------------------------------------------------ threads
    def spawn(self, fn: Callable, args: tuple = (), name: str = "sim") -> _Task:
        """A new simulated thread, runnable now (called by the running thread, or before :meth:`run`)."""
        t = _Task(name)
        self.tasks.append(t)
        self._push(t, self.now)
        threading.Thread(target=self._main, args=(t, fn, args), daemon=True, name=name).start()
        return t

    def run(self, timeout_s: Optional[float] = None) -> None:
        """Run the spawned threads to their end (called by a thread outside the simulation)."""
        nxt = self._next()
        if nxt is not None:
            self._resume(nxt)
            if not self._finished.wait(timeout_s):
                raise TimeoutError(f"the simulated run did not end within {timeout_s:.0f} s of wall clock")

    def _main(self, t: _Task, fn: Callable, args: tuple) -> None:
        t.go.wait()
        t.go.clear()
        _tls.sim, _tls.task = self, t
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - a thread's own failure; the rank threads report theirs
            self.failure = self.failure or e
        finally:
            t.finished = True
            for j in t.joiners:
                self.wake(j)
            self._idle_polls = 0
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


# ---------------------------------------------------------------------- simulated primitives
class SimLock:
    def __init__(self, sim: Simulation) -> None:
        self.sim, self.owner, self.waiters = sim, None, []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = self.sim.me()
        end = None if timeout is None or timeout < 0 else self.sim.now + timeout
        while self.owner is not None:
            if not blocking or (end is not None and self.sim.now >= end):
                return False
            self.waiters.append(me)
            try:
                self.sim.pause(end, "a lock")
            finally:
                if me in self.waiters:
                    self.waiters.remove(me)
        self.owner = me
        return True

    def release(self) -> None:
        if self.owner is None:
            raise RuntimeError("release of an unlocked lock")
        self.owner = None
        for w in list(self.waiters):
            self.sim.wake(w)

    def locked(self) -> bool:
        return self.owner is not None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class SimCondition:
    def __init__(self, sim: Simulation, lock: Optional[SimLock] = None) -> None:
        self.sim, self._lock, self.waiters = sim, lock or SimLock(sim), []

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        me = self.sim.me()
        self.waiters.append(me)
        self._lock.release()
        try:
            return self.sim.pause(None if timeout is None else self.sim.now + max(0.0, timeout), "a condition")
        finally:
            if me in self.waiters:
                self.waiters.remove(me)
            self._lock.acquire()

    def wait_for(self, predicate: Callable[[], Any], timeout: Optional[float] = None) -> Any:
        end = None if timeout is None else self.sim.now + timeout
        result = predicate()
        while not result:
            if end is not None:
                left = end - self.sim.now
                if left <= 0:
                    break
                self.wait(left)
            else:
                self.wait()
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        for w in self.waiters[:n]:
            self.sim.wake(w)
        del self.waiters[:n]

    def notify_all(self) -> None:
        self.notify(len(self.waiters))


class SimEvent:
    def __init__(self, sim: Simulation) -> None:
        self.sim, self._flag, self.waiters = sim, False, []

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        for w in self.waiters:
            self.sim.wake(w)
        self.waiters.clear()

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        end = None if timeout is None else self.sim.now + timeout
        while not self._flag:
            if end is not None and self.sim.now >= end:
                break
            me = self.sim.me()
            self.waiters.append(me)
            try:
                self.sim.pause(end, "an event")
            finally:
                if me in self.waiters:
                    self.waiters.remove(me)
        return self._flag


class SimThread:
    def __init__(self, sim: Simulation, target: Callable, args: tuple = (), name: Optional[str] = None,
                 daemon: bool = True) -> None:
        self.sim, self.target, self.args = sim, target, tuple(args)
        self.name = name or "sim-thread"
        self.daemon = daemon
        self._task: Optional[_Task] = None

    def start(self) -> None:
        self._task = self.sim.spawn(self.target, self.args, self.name)

    def join(self, timeout: Optional[float] = None) -> None:
        t = self._task
        if t is None:
            raise RuntimeError("cannot join a thread before it is started")
        end = None if timeout is None else self.sim.now + timeout
        me = self.sim.me()
        while not t.finished:
            if end is not None and self.sim.now >= end:
                return
            t.joiners.append(me)
            try:
                self.sim.pause(end, f"thread {t.name}")
            finally:
                if me in t.joiners:
                    t.joiners.remove(me)

    def is_alive(self) -> bool:
        return self._task is not None and not self._task.finished


class SimFuture:
    """The part of ``concurrent.futures.Future`` the algorithms use."""

    def __init__(self, sim: Simulation) -> None:
        self._cv = SimCondition(sim)
        self._done, self._result, self._exc = False, None, None

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def _finish(self, result: Any, exc: Optional[BaseException]) -> None:
        with self._cv:
            self._done, self._result, self._exc = True, result, exc
            self._cv.notify_all()

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(None, exc)

    def done(self) -> bool:
        return self._done

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        with self._cv:
            if not self._cv.wait_for(lambda: self._done, timeout):
                raise TimeoutError("the simulated future is not done")
            return self._exc

    def result(self, timeout: Optional[float] = None) -> Any:
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self._result


class SimQueue:
    """An unbounded FIFO (what ``queue.SimpleQueue`` is to the real threads)."""

    def __init__(self, sim: Simulation) -> None:
        self._cv = SimCondition(sim)
        self._items: collections.deque = collections.deque()

    def put(self, item: Any) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def get(self) -> Any:
        with self._cv:
            self._cv.wait_for(lambda: self._items)
            return self._items.popleft()


# ---------------------------------------------------------------------- the runtime the code asks for
def current() -> Optional[Simulation]:
    """The simulation of the calling thread, None outside one."""
    return getattr(_tls, "sim", None)


def lock():
    s = current()
    return SimLock(s) if s is not None else threading.Lock()


def condition(lk=None):
    s = current()
    return SimCondition(s, lk) if s is not None else threading.Condition(lk)


def event():
    s = current()
    return SimEvent(s) if s is not None else threading.Event()


def thread(target: Callable, args: tuple = (), name: Optional[str] = None, daemon: bool = True):
    s = current()
    if s is not None:
        return SimThread(s, target, args, name, daemon)
    return threading.Thread(target=target, args=args, name=name, daemon=daemon)


def future():
    s = current()
    return SimFuture(s) if s is not None else Future()


def queue():
    s = current()
    return SimQueue(s) if s is not None else queue_mod.SimpleQueue()


def clock() -> Callable[[], float]:
    """The clock the calling thread's code reads: virtual seconds in a simulation, else ``perf_counter``."""
    s = current()
    return s.clock if s is not None else time.perf_counter


def sleep(seconds: float) -> None:
    s = current()
    if s is not None:
        s.sleep(seconds)
    else:
        time.sleep(seconds)


def compute_step(rank: int, extra: Callable[[float], float]) -> float:
    """In a simulation: advance the calling thread by one step's virtual compute time (the model's
    time for ``rank`` plus ``extra(that time)``, the straggler simulator's share); returns it."""
    s = current()
    if s is None:
        raise RuntimeError("compute_step outside a simulation")
    base = s.step_seconds(rank)
    total = base + extra(base)
    s.sleep(total)
    return total


# ---------------------------------------------------------------------- messages
class Mailboxes:
    """Delayed FIFO messages between the ranks of a simulated world: (src, dst) -> deque of
    (delivery time, tensor)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self._boxes: dict[tuple[int, int], collections.deque] = {}
        self._last: dict[tuple[int, int], float] = {}
        self._waiting: dict[tuple[int, int], _Task] = {}

    def put(self, src: int, dst: int, t: torch.Tensor) -> None:
        key = (src, dst)
        at = max(self.sim.now + self.sim.transfer_seconds(t.numel() * t.element_size()), self._last.get(key, 0.0))
        self._last[key] = at
        self._boxes.setdefault(key, collections.deque()).append((at, t))
        w = self._waiting.pop(key, None)
        if w is not None:
            self.sim.wake(w)

    def get(self, src: int, dst: int) -> torch.Tensor:
        key = (src, dst)
        box = self._boxes.setdefault(key, collections.deque())
        while not box:
            self._waiting[key] = self.sim.me()
            try:
                self.sim.pause(None, f"a message from rank {src}")
            finally:
                self._waiting.pop(key, None)
        at, t = box[0]
        if at > self.sim.now:
            self.sim.pause(at, f"the delivery of a message from rank {src}", progress=True)
        box.popleft()
        return t
