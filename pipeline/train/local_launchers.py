"""The launchers that start the workers on this machine without Spark: ``local`` (one process per
worker, joined by torch.distributed over loopback) and ``inprocess`` (the workers as ranks on
threads of the calling process, :mod:`.comm.inprocess`; a run that depends on time -- an
asynchronous algorithm, time-budgeted rounds, stragglers -- under the simulated clock of
:mod:`.comm.simclock`, :func:`simulated`). Both report like the Spark launchers: rank-ordered
results, or the first failed rank's error."""
from __future__ import annotations

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
    depends on time (an asynchronous algorithm, also under SlowMo; time-budgeted local SGD; a time
    schedule of SwarmSGD; active stragglers), or ``simulated_clock.always``."""
    from .algorithms.async_common import ASYNC_ALGORITHMS, base_algorithm

    base, params = base_algorithm(cfg.algorithm.name, cfg.algorithm.params)
    return (cfg.simulated_clock.always or base in ASYNC_ALGORITHMS or base == "timed_local_sgd"
            or (base == "swarm" and params.get("schedule") == "time") or cfg.stragglers.active)


def clock_settings(cfg):
    """``cfg.simulated_clock`` with ``step_s`` resolved: as given, else the time budget's own step where
    the run has one (a time-mode round of ``round_seconds`` is meant to hold ``round_steps`` steps; a
    time-budgeted round ``nominal_steps``; SwarmSGD's ``local_steps``), else 0.01 s."""
    from .algorithms import validate_params
    from .algorithms.async_common import ASYNC_ALGORITHMS, base_algorithm

    clk = cfg.simulated_clock
    if clk.step_s is not None:
        return clk
    base, params = base_algorithm(cfg.algorithm.name, cfg.algorithm.params)
    p = validate_params(base, params)
    per_round = {"timed_local_sgd": "nominal_steps", "swarm": "local_steps"}.get(
        base, "round_steps" if base in ASYNC_ALGORITHMS else None)
    seconds = getattr(p, "round_seconds", None)
    step = seconds / getattr(p, per_round) if per_round and seconds else 0.01
    return clk.model_copy(update={"step_s": step})


def run_inprocess(args: tuple, world: int, timeout_s: float) -> list[dict]:
    """The M workers as ranks on threads of this process (:mod:`.comm.inprocess`): no process starts,
    no sockets; under the simulated clock when :func:`simulated` (then every rank's summary carries
    ``simulated_clock``: virtual seconds, thread switches, a digest of the order the threads ran in).
    Raises the first failed rank's error (a rank that stopped because another failed is not
    reported)."""
    import threading

    from .comm.inprocess import InProcessWorld, PeerFailed, bind
    from .comm.simcore import SimDeadlock, Simulation
    from .config import TrainConfig
    from .entry import worker_entry
    from .restart import WorkerLost

    cfg = TrainConfig.model_validate_json(args[0])
    sim = Simulation(clock_settings(cfg), seed=cfg.seed) if simulated(cfg) else None
    meeting = InProcessWorld(world, timeout_s=max(60.0, float(timeout_s)), sim=sim)
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        bind(meeting, rank)
        try:
            results[rank] = worker_entry(*args)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[rank] = e
            meeting.abort()

    if sim is None:
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for r in range(world):
            sim.spawn(rank_main, (r,), f"rank-{r}")
        sim.run(timeout_s)
        for res in results.values():
            for entry in res.get("ranks", []):
                entry["simulated_clock"] = sim.summary()
    consequences = (PeerFailed, SimDeadlock)
    roots = {r: e for r, e in errors.items() if not isinstance(e, consequences)}
    return local_outcome(world, results, roots or errors, {}, WorkerLost)


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


