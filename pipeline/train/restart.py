"""Surviving a lost worker: relaunch the workers and resume from the newest complete checkpoint.

:func:`supervise` runs one launch of the workers; when it fails for any reason other than a
bad input or config (a worker killed by a signal or the OOM killer, an executor lost, a
peer's broken connection), it finds the newest complete checkpoint (corrupt ones are skipped,
see ``checkpoint.newest_complete``), logs a warning and relaunches the workers resuming from it,
up to ``cfg.max_restarts`` times. Each restart becomes a record
``{"kind": "restart", "restart", "time", "worker", "failure", "from_step", "checkpoint",
"bit_identical"}`` in ``metrics.jsonl`` (at its position in the step sequence) and in
``summary.json["restarts"]``. After the last allowed failure the run ends with one line naming
the failure and the checkpoint it could resume from (:class:`TrainingFailed`, exit code 1).

Algorithms whose steps depend on wall-clock time or message arrival (time-budgeted rounds,
asynchronous algorithms) resume from the checkpoint too, with a warning that the continuation
is not bit-identical to an uninterrupted run.

Fault injection for tests and drills (``inject_fault``): ``debug.fail_at_step`` (+ ``fail_rank``,
``fail_mode``), on the first launch only: a relaunch clears it.
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import logging
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import PipelineError
from . import checkpoint

log = logging.getLogger(__name__)

#: algorithms whose continuation after a resume differs from an uninterrupted run
INEXACT_ALGORITHMS = ("timed_local_sgd", "adpsgd", "eawild", "async_ps")


class TrainingFailed(PipelineError):
    """Training failed and could not (or may no longer) be restarted."""

    exit_code = 1


class WorkerLost(RuntimeError):
    """A worker process ended without a result (killed by a signal, out of memory, ...)."""

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


# ---------------------------------------------------------------------------- fault injection
def _debug_value(cfg_or_debug, key: str):
    dbg = getattr(cfg_or_debug, "debug", None)
    if dbg is not None and hasattr(dbg, key):
        return getattr(dbg, key)
    return getattr(cfg_or_debug, key, None)


def inject_fault(cfg_or_debug, rank: int, step: int) -> None:
    """Testing aid called by the worker after each step: at ``fail_at_step`` on ``fail_rank``
    (every rank when None) raise a RuntimeError (``fail_mode=raise``), end this process at once
    (``exit``: ``os._exit(17)``), SIGKILL it (``kill``: what an OOM kill looks like) or block
    it for good (``hang``: what a deadlock looks like; ``stall_timeout`` ends it)."""
    at = _debug_value(cfg_or_debug, "fail_at_step")
    if at is None or step != at:
        return
    who = _debug_value(cfg_or_debug, "fail_rank")
    if who is not None and int(who) != rank:
        return
    mode = _debug_value(cfg_or_debug, "fail_mode") or "raise"
    if mode == "hang":
        log.warning("rank %d: fail_at_step=%d reached: this worker blocks for good (hang)", rank, step)
        threading.Event().wait()
    if mode in ("kill", "exit"):
        log.warning("rank %d: fail_at_step=%d reached: this worker process dies (%s)", rank, step, mode)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(17)
    raise RuntimeError(f"fail_at_step={at} reached (simulated crash)")


def without_faults(cfg):
    """``cfg`` for a relaunch: the same config without the injected fault (the checkpoint to
    resume from travels in the plan, ``plan["resume_from"]``)."""
    dbg = getattr(cfg, "debug", None)
    update: dict[str, Any] = {}
    if dbg is not None and hasattr(dbg, "fail_at_step"):
        update["debug"] = dbg.model_copy(update={"fail_at_step": None})
    elif "fail_at_step" in type(cfg).model_fields:
        update["fail_at_step"] = None
    return cfg.model_copy(update=update)


# ---------------------------------------------------------------------------- what can resume exactly
def _params_mention(params: Any, keys: tuple[str, ...]) -> bool:
    if isinstance(params, dict):
        return any(k in keys and v not in (None, "fixed") for k, v in params.items()) or \
            any(_params_mention(v, keys) for v in params.values())
    return False


def resumes_exactly(cfg) -> bool:
    """False for algorithms whose steps depend on time or message arrival (time budgets,
    geometric/time-scheduled SwarmSGD, asynchronous algorithms), also when nested (SlowMo's base)."""
    a = cfg.algorithm
    if a.name in INEXACT_ALGORITHMS or any(f'"{n}"' in json.dumps(a.params) for n in INEXACT_ALGORITHMS):
        return False
    return not _params_mention(a.params, ("round_seconds", "schedule"))


# ---------------------------------------------------------------------------- where a run starts
def start_checkpoint(cfg, ck, expected_fp: dict):
    """The checkpoint a launch resumes from, per ``cfg.resume``: False -> none (the directory is
    emptied so runs never mix); True -> the newest complete one (ConfigError if its config
    differs); ``auto`` -> the newest complete one of the same config, else none (emptied).
    ``ck`` is a :class:`~pipeline.fs.Location` (``checkpoint.where``: local or object store); so
    is the checkpoint returned."""
    found = checkpoint.newest_complete(ck) if cfg.resume else None
    if cfg.resume == "auto" and found is not None and not checkpoint.matches(found[1], expected_fp):
        log.warning("resume=auto: the checkpoints in %s belong to another config; starting fresh", ck)
        found = None
    if found is None and cfg.resume is not True:
        _empty(ck)
    if found is None:
        if cfg.resume:
            log.info("resume: no complete checkpoint in %s, starting fresh", ck)
        return None
    checkpoint.check_fingerprint(found[0], found[1], expected_fp)
    log.info("resuming from %s (step %d)", found[0], found[1]["step"])
    return found[0]


def _empty(ck) -> None:
    """Remove every checkpoint under ``ck`` (a local directory is recreated empty; an object-store
    prefix simply has no objects left)."""
    loc = checkpoint.where(ck)
    checkpoint.remove(loc)
    if loc.is_local:
        Path(loc.path).mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------------------- the supervisor
def _failed_rank(exc: BaseException) -> Optional[int]:
    if isinstance(exc, WorkerLost):
        return exc.rank
    m = re.search(r"\b(?:rank|local_rank)[\s:=]+(\d+)", str(exc))
    return int(m.group(1)) if m else None


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


#: failures a relaunch would meet again: bad inputs/configs, and a disk that is full or not writable
_PERMANENT = ("BadInputError:", "ConfigError:", "No space left on device", "Read-only file system",
              "Permission denied", "Disk quota exceeded")


def is_restartable(exc: BaseException) -> bool:
    """Everything but what fails the same way again (see ``_PERMANENT``) and an interrupt."""
    if isinstance(exc, PipelineError):
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        return False
    text = str(exc)
    return not any(n in text for n in _PERMANENT)


def supervise(launch: Callable[[Any, Optional[str]], list[dict]], cfg, ck, expected_fp: dict,
              start) -> tuple[list[dict], list[dict]]:
    """``launch(cfg, resume_from) -> results``, relaunched after a lost worker (see module doc).
    Returns (results of the successful launch, restart records)."""
    restarts: list[dict] = []
    resume_from, attempt_cfg = start, cfg
    while True:
        try:
            return launch(attempt_cfg, str(resume_from) if resume_from else None), restarts
        except Exception as exc:  # noqa: BLE001 - classified below (an interrupt is never restarted)
            if not is_restartable(exc):
                raise
            failure = one_line(exc)
            found = checkpoint.newest_complete(ck)
            if found is not None and not checkpoint.matches(found[1], expected_fp):
                found = None
            where = f"checkpoint {found[0]} (step {found[1]['step']})" if found else "no checkpoint (start over)"
            if len(restarts) >= cfg.max_restarts:
                raise TrainingFailed(f"training failed after {len(restarts)} restart(s) (max_restarts="
                                     f"{cfg.max_restarts}): {failure}; it can resume from {where} with "
                                     "resume=true") from exc
            exact = resumes_exactly(cfg)
            rec = {"kind": "restart", "restart": len(restarts) + 1,
                   "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   "worker": _failed_rank(exc), "failure": failure,
                   "from_step": int(found[1]["step"]) if found else 0,
                   "checkpoint": str(found[0]) if found else None, "bit_identical": exact}
            restarts.append(rec)
            log.warning("worker %s lost (%s): restart %d/%d from %s", rec["worker"] if rec["worker"] is not None
                        else "?", failure, rec["restart"], cfg.max_restarts, where)
            if not exact:
                log.warning("algorithm %s does not resume exactly: the continuation from step %d is not "
                            "bit-identical to an uninterrupted run", cfg.algorithm.name, rec["from_step"])
            resume_from = found[0] if found else None
            attempt_cfg = without_faults(cfg)
            if resume_from is None:
                _empty(ck)


def record_restarts(metrics_path, restarts: list[dict]) -> None:
    """Insert the restart records into ``metrics.jsonl`` (a local path or an object-store
    location) after the last record at or before the step each restart resumed from."""
    from ..fs import location, read_bytes_if_exists, write_bytes

    loc = location(metrics_path, output=True)
    data = read_bytes_if_exists(loc) if restarts else None
    if data is None:
        return
    recs = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    for r in restarts:
        pos = 0
        for i, m in enumerate(recs):
            if m.get("kind") != "restart" and int(m.get("step") or 0) > r["from_step"]:
                break
            pos = i + 1
        recs.insert(pos, r)
    write_bytes(loc, "".join(json.dumps(m) + "\n" for m in recs).encode())
