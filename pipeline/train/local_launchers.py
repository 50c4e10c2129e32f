"""The launchers that start the workers on this machine without Spark: ``local`` (one process per
worker, joined by torch.distributed over loopback) and ``inprocess`` (the workers as ranks on
threads of the calling process, :mod:`.comm.inprocess`; a run that depends on time -- an
asynchronous algorithm, time-budgeted rounds, stragglers -- under the simulated clock of
:mod:`.comm.simclock`, :func:`simulated`). Both report like the Spark launchers: rank-ordered
results, or the first failed rank's error."""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import time
from typing import Any, Optional

from .comm.ports import free_port
from .comm.rendezvous import RUN_SECRET_ENV, new_run_secret


def _end_with(launcher: int, poll_s: float = 1.0) -> None:
    """End this worker (exit code 70) once the launching process is gone: a job killed outright or by
    SIGTERM runs no cleanup, and a worker is a child of the fork server, not of the job, so nothing
    else would stop a worker that blocks on a dead peer."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            try:
                os.kill(launcher, 0)
            except (ProcessLookupError, PermissionError):   # gone (or its pid now another user's)
                os._exit(70)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _local_child(rank: int, world: int, host: str, port: int, args: tuple, queue, env: dict,
                 launcher: int) -> None:
    _end_with(launcher)
    os.environ.clear()   # the launching process's environment now, as a spawned child would have it
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": host, "MASTER_PORT": str(port)})
    from .entry import worker_entry

    try:
        queue.put((rank, worker_entry(*args), None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
            e = RuntimeError(f"{type(e).__name__}: {e}")
        queue.put((rank, None, e))


#: what every local worker imports: loaded once into the fork server, then inherited by each fork.
#: Imported later by every worker, each about 0.9 s of one core here: ``torch._dynamo`` (torch
#: imports its compiler stack, about 800 modules, when a process makes its first optimizer) and
#: ``sklearn.metrics`` (the per-class AUC of the first evaluation).
PRELOAD = ("torch", "torch._dynamo", "sklearn.metrics", f"{__package__}.entry")


def worker_context():
    """The multiprocessing context of the local workers: ``forkserver`` with torch and the worker
    code preloaded, so a worker is a fork of a process that imported them once (under ``spawn``
    each of M workers imports torch and the pipeline itself, seconds of CPU each: most of a local
    run's start at M = 16 on 2 cores). The server is started once per launching process and only
    ever imports: no torch thread pool, no communicator exists in it to be inherited. Each worker
    gets the launching process's environment of the moment (:func:`_local_child`). ``spawn``
    where the platform has no fork server."""
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def run_local(args: tuple, world: int, grace_s: float = 20.0, poll_s: float = 0.5,
               host: Optional[str] = None) -> list[dict]:
    """M local processes joined by torch.distributed (gloo). A process that dies without a
    result (killed, out of memory) is noticed within ``poll_s``; once one rank failed, the others
    get ``grace_s`` to finish or fail before they are terminated. Raises the first rank's bad-input
    error as it is, :class:`~pipeline.train.restart.WorkerLost` for a dead process, else a
    RuntimeError naming every failed rank."""
    import queue as queue_mod

    from .entry import worker_entry
    from .restart import WorkerLost

    if world == 1:
        cfg_json, _, plan, out, ck = args
        return [worker_entry(cfg_json, "local", plan, out, ck)]
    ctx = worker_context()
    queue = ctx.Queue()
    host = host or "127.0.0.1"   # every worker on this machine: the rendezvous listens on loopback by default
    port = free_port(host)
    argv = (args[0], "torch") + tuple(args[2:])
    env = dict(os.environ)
    env[RUN_SECRET_ENV] = new_run_secret()   # signs the ranks' keys in the rendezvous store; never in ours
    me = os.getpid()
    procs = [ctx.Process(target=_local_child, args=(r, world, host, port, argv, queue, env, me), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    lost: dict[int, int] = {}
    first_failure = None
    try:
        while len(results) + len(errors) + len(lost) < world:
            try:
                rank, res, err = queue.get(timeout=poll_s)
                if err is None:
                    results[rank] = res
                else:
                    errors[rank] = err
                    first_failure = first_failure or time.monotonic()
                continue
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in results and r not in errors and r not in lost and p.exitcode not in (None, 0):
                    lost[r] = p.exitcode
                    first_failure = first_failure or time.monotonic()
            if first_failure is not None and time.monotonic() - first_failure > grace_s:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        queue.close()
    return local_outcome(world, results, errors, lost, WorkerLost)


def simulated(cfg) -> bool:
    """Whether an inprocess run of ``cfg`` (a TrainConfig) runs under the simulated clock: its result
    depends on time (the algorithm, under any SlowMo, declares so: ``algorithms.time_round_steps``; an
    asynchronous algorithm, time-budgeted rounds, a time schedule of SwarmSGD), active stragglers, a set ``cluster`` (its costs are the clock's),
    or ``simulated_clock.always``."""
    from .algorithms import time_round_steps

    return (cfg.simulated_clock.always or cfg.stragglers.active or cfg.cluster.enabled
            or time_round_steps(cfg.algorithm.name, cfg.algorithm.params) is not None)


def clock_settings(cfg, local_batch: Optional[int] = None):
    """``cfg.simulated_clock`` with ``step_s`` resolved: as given, else the cluster's compute profile at
    the run's ``local_batch`` (``cluster.compute_step_s``), else the time budget's own step where
    the run has one (a round of ``round_seconds`` is meant to hold the steps the algorithm declares:
    ``algorithms.time_round_steps``), else 0.01 s."""
    from .algorithms import time_round_steps, validate_params
    from .algorithms.async_common import base_algorithm

    clk = cfg.simulated_clock
    if clk.step_s is not None:
        return clk
    if cfg.cluster.compute_step_s is not None and local_batch is not None:
        return clk.model_copy(update={"step_s": cfg.cluster.step_seconds(local_batch)})
    base, params = base_algorithm(cfg.algorithm.name, cfg.algorithm.params)
    steps = time_round_steps(base, params)
    seconds = getattr(validate_params(base, params), "round_seconds", None)
    step = seconds / steps if steps and seconds else 0.01
    return clk.model_copy(update={"step_s": step})


#: seconds the threads of an ended in-process run get to unwind, before and after they are interrupted
END_GRACE_S = 5.0
#: threads of an earlier in-process run in this process that could not be ended (blocked in a C call)
_LEFTOVER: list = []


def run_inprocess(args: tuple, world: int) -> list[dict]:
    """The M workers as ranks on threads of this process (:mod:`.comm.inprocess`): no process starts,
    no sockets; under the simulated clock when :func:`simulated` (then every rank's summary carries
    ``simulated_clock``: virtual seconds, thread switches, a digest of the order the threads ran in).
    Raises the first failed rank's error (a rank that stopped because another failed is not
    reported).

    Its only time limit is the stall limit, in wall-clock seconds (``stall_timeout``; 0: none), as the
    worker watchdog's in a process of its own: a rank that completes no step, evaluation or
    checkpoint for that long, blocked in a collective or outside one, ends the run
    (:meth:`~.comm.inprocess.InProcessWorld.end`); its threads get :data:`END_GRACE_S` to unwind, a
    rank thread that does not is interrupted, and the launcher raises one line naming the rank
    (:class:`~.restart.WorkerLost`, relaunched like a stalled worker process). A simulated run's
    virtual seconds count toward nothing. No thread of the run outlives the call; one that cannot be
    ended (blocked inside a C call) fails the run with :class:`~.restart.TrainingFailed`, and this
    process refuses every later in-process run."""
    import threading

    from .comm.inprocess import InProcessWorld, PeerFailed, bind
    from .comm.simcore import RunEnded, SimDeadlock, Simulation
    from .config import TrainConfig
    from .entry import worker_entry
    from .restart import TrainingFailed, WorkerLost

    left = [t.name for t in _LEFTOVER if t.is_alive()]
    if left:
        raise TrainingFailed(f"launcher inprocess: thread(s) {', '.join(left)} of an earlier in-process run of this "
                             "process still run (blocked inside a C call); start a new process for the next run")
    cfg = TrainConfig.model_validate_json(args[0])
    for m in PRELOAD:       # once, before the ranks: M threads importing torch._dynamo at their first step
        importlib.import_module(m)      # wait on each other for seconds (and count toward the stall limit)
    sim = (Simulation(clock_settings(cfg, args[2].get("batch_size")), seed=cfg.seed, cost=cfg.cluster.resolve(world))
           if simulated(cfg) else None)
    meeting = InProcessWorld(world, sim=sim, stall_s=cfg.stall_timeout)
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    all_done = threading.Event()

    def rank_main(rank: int) -> None:
        bind(meeting, rank)
        try:
            results[rank] = worker_entry(*args)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[rank] = e
            meeting.abort()
        finally:
            meeting.finished(rank)
            if len(meeting.done) == world:
                all_done.set()

    threads: list = []
    if sim is None:
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
    else:
        for r in range(world):
            sim.spawn(rank_main, (r,), f"rank-{r}")
        sim.start()
    finished = all_done.wait if sim is None else sim.wait
    poll = min(1.0, cfg.stall_timeout / 4) if cfg.stall_timeout else 1.0
    stall = None
    while not finished(poll):
        stall = meeting.stalled()
        if stall is not None:
            break
    before_end = dict(errors)
    if stall is not None:
        rank, idle = stall
        why = (f"rank {rank}: stalled: no step, evaluation or checkpoint completed for {idle:.0f} s "
               f"(stall_timeout={cfg.stall_timeout:g}); the in-process run was ended")
        meeting.end(why)
        stuck = _wind_down(sim, threads, rank)
        if stuck:
            _LEFTOVER.extend(stuck)
            raise TrainingFailed(f"{why}; its thread(s) {', '.join(t.name for t in stuck)} could not be stopped "
                                 "(blocked inside a C call): this process runs no further in-process run")
    for t in threads:
        t.join()
    consequences = (PeerFailed, SimDeadlock, RunEnded)
    # once the run is ended, what the unwinding threads raise is a consequence of the stall
    roots = {r: e for r, e in (before_end if stall is not None else errors).items() if not isinstance(e, consequences)}
    if stall is not None and not roots:
        raise WorkerLost(why, rank=stall[0])
    if sim is not None:
        for res in results.values():
            for entry in res.get("ranks", []):
                entry["simulated_clock"] = sim.summary()
    return local_outcome(world, results, roots or errors, {}, WorkerLost)


def _wind_down(sim, threads: list, rank: int) -> list:
    """After ``InProcessWorld.end`` (every wait and beat of the run raises): a second for the run's
    threads to unwind; then interrupt the thread of the stalled ``rank`` (a simulated run: the thread
    holding the clock) and give them :data:`END_GRACE_S`; then interrupt every rank thread still
    running (a simulated run: release the parked ones) and wait as long again. Returns the threads
    still alive."""
    from .comm.inprocess import interrupt

    grace_s = END_GRACE_S

    def alive() -> list:
        every = threads if sim is None else [k.thread for k in sim.tasks]
        return [t for t in every if t is not None and t.is_alive()]

    def settle(seconds: float = grace_s) -> list:
        end = time.monotonic() + seconds
        while alive() and time.monotonic() < end:
            time.sleep(0.02)
        return alive()

    if not settle(min(1.0, grace_s)):       # every wait and beat raises now: most runs unwind here
        return []
    holder = threads[rank] if sim is None else (sim.current.thread if sim.current is not None else None)
    if holder is not None:
        interrupt(holder)
    if not settle():
        return []
    if sim is None:
        for t in alive():
            interrupt(t)
    else:
        sim.release()
    return settle()


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def local_outcome(world, results, errors, lost, lost_cls) -> list[dict]:
    from ..errors import PipelineError

    for r in sorted(errors):
        if isinstance(errors[r], PipelineError):
            raise errors[r]
    # a peer's broken connection is a consequence of another failure: report the root one
    root = {k: e for k, e in errors.items() if not any(m in str(e) for m in _PEER_LOST)}
    if lost:
        r = min(lost)
        code = lost[r]
        how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
            else f"exit code {code}"
        others = "; ".join(f"rank {k}: {type(e).__name__}: {e}" for k, e in sorted(root.items()))
        raise lost_cls(f"rank {r}: worker process died ({how})" + (f"; then {others}" if others else ""), rank=r)
    root = root or errors
    if len(root) == 1:
        raise next(iter(root.values()))
    if root:
        raise RuntimeError("; ".join(f"rank {k}: {type(e).__name__}: {e}" for k, e in sorted(root.items())))
    missing = [r for r in range(world) if r not in results]
    if missing:
        raise lost_cls(f"ranks {missing} gave no result", rank=missing[0])
    return [results[r] for r in range(world)]


