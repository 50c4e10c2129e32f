"""A deterministic simulated clock for the ranks of one process (the ``inprocess`` launcher's runs that
depend on time: asynchronous algorithms, time-budgeted rounds, stragglers).

The threads of a simulated run (every rank's training thread and the threads the algorithms start:
AD-PSGD's communication thread, the serving threads, a centre link's sending thread) are real
threads, but **exactly one runs at a time**: it holds the baton until it yields, and then the
thread due first in virtual time runs next. A thread yields when it

* computes a step (:func:`compute_step`: its compute time, from the per-worker model below),
* sleeps (:func:`sleep`), waits for a lock, a condition, an event, a future or a thread, or
* receives a message not yet delivered (:class:`SimChannel`: delivery after ``latency_s`` plus
  the bytes over ``bytes_per_s``, or after what the simulation's cluster model, :mod:`.costmodel`,
  says the message costs).

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
import queue as queue_mod
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Optional

from .simcore import Simulation, _Task, current

if TYPE_CHECKING:
    import torch


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
    s.ledger.compute(rank, total)
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
        self._transit: list[tuple[int, int, float]] = []     # messages in flight: (src, dst, delivery)

    def put(self, src: int, dst: int, t: torch.Tensor) -> None:
        key = (src, dst)
        now = self.sim.now
        self._transit = [(a, b, end) for a, b, end in self._transit if end > now]
        flows = self.sim.cost.concurrent(src, dst, [(a, b) for a, b, _ in self._transit])
        cost = self.sim.cost.p2p(src, dst, t.numel() * t.element_size(), flows)
        self.sim.ledger.comm(src, 0.0, cost)
        at = max(now + cost.seconds, self._last.get(key, 0.0))
        self._transit.append((src, dst, at))
        self._last[key] = at
        self._boxes.setdefault(key, collections.deque()).append((at, t))
        w = self._waiting.pop(key, None)
        if w is not None:
            self.sim.wake(w)

    def get(self, src: int, dst: int) -> torch.Tensor:
        key = (src, dst)
        t0 = self.sim.now
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
        self.sim.ledger.comm(dst, self.sim.now - t0)     # the time it waited for the message
        return t
