"""Surviving a lost worker: relaunch the workers and resume from the newest complete checkpoint.

:func:`supervise` runs one launch of the workers; when it fails transiently (a worker killed by
a signal or the OOM killer, an executor lost, a peer's broken connection, a stalled worker: see
:func:`is_restartable`), it finds the newest complete checkpoint (corrupt ones are skipped,
see ``checkpoint.newest_complete``), logs a warning and relaunches the workers resuming from it,
up to ``cfg.max_restarts`` times. Each restart becomes a record
``{"kind": "restart", "restart", "time", "worker", "failure", "from_step", "checkpoint",
"bit_identical"}`` in ``metrics.jsonl`` (at its position in the step sequence) and in
``summary.json["restarts"]``. After the last allowed failure the run ends with one line naming
the failure and the checkpoint it could resume from (:class:`TrainingFailed`, exit code 1). What
a relaunch would meet again ends the run at once: a bad input or config, a full or read-only
disk, a module that is not installed (one line naming what to install or which launcher to
choose), an error in the code (ImportError, TypeError, NameError, SyntaxError), a ValueError (a bad
setting or value that the driver did not check: a relaunch gets the same config).

:func:`start_checkpoint` decides where the first launch starts, and what a fresh start may delete
(only checkpoint files, never those of a run that did not finish unless told to).

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
import time
from typing import Any, Callable, Optional

from ..errors import ConfigError, PipelineError
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
    (every rank when None) raise a RuntimeError (``fail_mode=raise``) or a TypeError (``type_error``: an
    error in the code, never restarted), end this process at once
    (``exit``: ``os._exit(17)``), SIGKILL it (``kill``: what an OOM kill looks like) or block
    it for good (``hang``: what a deadlock looks like; ``stall_timeout`` ends it)."""
    at = _debug_value(cfg_or_debug, "fail_at_step")
    if at is None or step != at:
        return
    who = _debug_value(cfg_or_debug, "fail_rank")
    if who is not None and int(who) != rank:
        return
    mode = _debug_value(cfg_or_debug, "fail_mode") or "raise"
    if mode == "type_error":
        raise TypeError(f"fail_at_step={at} reached (simulated error in the code)")
    if mode == "hang":
        log.warning("rank %d: fail_at_step=%d reached: this worker blocks for good (hang)", rank, step)
        while True:      # in Python, not one C call: the inprocess launcher can interrupt a rank thread
            time.sleep(0.1)
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
#: how a user says "continue" or "start over", named in the messages below
RESUME_HINT = "resume=true (--set resume=true; train.resume=true in a workflow config)"
FRESH_HINT = "fresh_start=true"


def start_checkpoint(cfg, ck, expected_fp: dict):
    """The checkpoint a launch resumes from, per ``cfg.resume`` (``ck``: a
    :class:`~pipeline.fs.Location`, local or object store; so is the checkpoint returned).

    First of all, ``ck`` must hold nothing but checkpoints (``checkpoint.check_own``: one line
    naming what else is there, nothing deleted). Then: ``true`` -> the newest complete checkpoint
    (ConfigError if its config differs); ``auto`` -> the newest complete one of the same config;
    otherwise the run starts fresh and deletes the checkpoints in ``ck`` -- saying first which
    checkpoint it deletes and how to resume it -- but only when the run that wrote them finished
    (``checkpoint.finished``) or ``cfg.fresh_start`` is set: the checkpoint of a run that did not
    finish (the one a failure message says it "can resume from") is refused with one line instead,
    and so are checkpoints whose meta cannot be verified (``checkpoint.check_verifiable``: unreadable,
    another format version); only ``fresh_start`` deletes them."""
    checkpoint.check_own(ck)
    found = checkpoint.newest_complete(ck)
    if found is not None and cfg.resume is True:
        checkpoint.check_fingerprint(found[0], found[1], expected_fp)
        log.info("resuming from %s (step %d)", found[0], found[1]["step"])
        return found[0]
    if found is not None and cfg.resume == "auto" and checkpoint.matches(found[1], expected_fp):
        log.info("resuming from %s (step %d)", found[0], found[1]["step"])
        return found[0]
    if found is None:  # nothing to resume from; what is there was cut short, corrupt or of an older format
        if cfg.resume:
            log.info("resume: no complete checkpoint in %s, starting fresh", ck)
        else:
            if not cfg.fresh_start:     # never delete what this run cannot verify unless told to
                checkpoint.check_verifiable(ck, FRESH_HINT)
            gone = checkpoint.clear(ck)
            if gone:
                log.warning("starting fresh: deleted %d checkpoint(s) in %s that cannot be resumed from (%s)",
                            len(gone), ck, ", ".join(p.name for p in gone))
        return None
    path, meta = found
    other = "" if checkpoint.matches(meta, expected_fp) else " with another config"
    if not checkpoint.finished(meta) and not cfg.fresh_start:
        how = f"continue it with {RESUME_HINT}, or" if not other else "use another checkpoint_dir, or"
        raise ConfigError(f"checkpoint_dir {ck} holds checkpoint {path} (step {meta['step']}) of a run{other} that "
                          f"did not finish; resume={str(cfg.resume).lower()} would delete it: {how} delete it and "
                          f"start over with {FRESH_HINT}")
    if not cfg.fresh_start:
        checkpoint.check_verifiable(ck, FRESH_HINT)
    log.warning("starting fresh (resume=%s): deleting the checkpoints in %s of an earlier run%s; the newest, %s "
                "(step %d), could be continued with %s", str(cfg.resume).lower(), ck, other, path, meta["step"],
                RESUME_HINT)
    checkpoint.clear(ck)
    return None


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
#: errors in the code or the installation, which a relaunch would meet again; a launcher that reports
#: a worker's failure as text (Horovod, torchrun, several local ranks) is matched by the type's name
_CODE_ERRORS = (ImportError, TypeError, NameError, SyntaxError)
_CODE_ERROR_TEXT = re.compile(r"\b(?:ModuleNotFoundError|ImportError|TypeError|NameError|SyntaxError): ")
_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")
#: a bad value (a setting the driver did not check, a value out of range): a relaunch gets the same config
_BAD_VALUE_TEXT = re.compile(r"\bValueError: ")


def code_error(exc: BaseException) -> bool:
    """An error in the code or the installation (ImportError, TypeError, NameError, SyntaxError),
    raised here or reported by a launcher; a lost worker never is one, whatever its peers said."""
    if isinstance(exc, WorkerLost):
        return False
    return isinstance(exc, _CODE_ERRORS) or bool(_CODE_ERROR_TEXT.search(str(exc)))


def bad_value(exc: BaseException) -> bool:
    """A ValueError (a bad setting or value), raised here or reported by a launcher as text; a lost
    worker never is one, whatever its peers said."""
    if isinstance(exc, WorkerLost):
        return False
    return isinstance(exc, ValueError) or bool(_BAD_VALUE_TEXT.search(str(exc)))


def missing_module(exc: BaseException) -> Optional[str]:
    """The module a failed import names, if ``exc`` is (or reports) a ModuleNotFoundError."""
    if isinstance(exc, WorkerLost):
        return None
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return exc.name
    m = _MISSING_MODULE.search(str(exc))
    return m.group(1) if m else None


def is_restartable(exc: BaseException) -> bool:
    """A transient failure: everything but what fails the same way again (bad input or config, a
    ValueError, a full or read-only disk, an error in the code or the installation) and an interrupt."""
    if isinstance(exc, PipelineError):
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        return False
    text = str(exc)
    return not any(n in text for n in _PERMANENT) and not code_error(exc) and not bad_value(exc)


def install_hint(launcher: str, module: str, exc: BaseException) -> str:
    """One line for a module the run needs that is not installed: what to install, which launcher."""
    others = " or ".join(f"launcher={x}" for x in ("horovod", "torch", "local") if x != launcher)
    if module.split(".")[0] == "horovod":
        return (f"launcher={launcher}: Horovod is not installed ({one_line(exc)}): build it with "
                f"scripts/build_horovod.sh (make setup), or choose {others}")
    return (f"launcher={launcher}: the module {module!r} is not installed where the workers run ({one_line(exc)}): "
            f"install it (pip install {module.split('.')[0]}), or choose {others}")


def _resume_point(ck, expected_fp: dict):
    """(path, meta) of the newest complete checkpoint of this config in ``ck``, or None."""
    found = checkpoint.newest_complete(ck)
    if found is not None and not checkpoint.matches(found[1], expected_fp):
        return None
    return found


def _where(found) -> str:
    return f"checkpoint {found[0]} (step {found[1]['step']})" if found else "no checkpoint (start over)"


def _can_resume(found) -> str:
    """The end of a failure's one line: where and how it can resume."""
    if found is None:
        return "there is no checkpoint to resume from"
    return f"it can resume from {_where(found)} with {RESUME_HINT}"


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
                _fail_at_once(exc, cfg, ck, expected_fp)
            failure = one_line(exc)
            found = _resume_point(ck, expected_fp)
            where = _where(found)
            if len(restarts) >= cfg.max_restarts:
                raise TrainingFailed(f"training failed after {len(restarts)} restart(s) (max_restarts="
                                     f"{cfg.max_restarts}): {failure}; {_can_resume(found)}") from exc
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
            resume_from = found[0] if found else None  # None: from the start (nothing is deleted)
            attempt_cfg = without_faults(cfg)


def _fail_at_once(exc: Exception, cfg, ck, expected_fp: dict) -> None:
    """Raise what ends the run without a restart: a missing module as one line naming what to
    install or which launcher to choose (exit 2), an error in the code or a ValueError as
    TrainingFailed (exit 1), anything else (bad input, config, disk) as it is."""
    module = missing_module(exc)
    if module:
        raise ConfigError(install_hint(cfg.launcher, module, exc)) from exc
    if code_error(exc):
        resume = _can_resume(_resume_point(ck, expected_fp))
        raise TrainingFailed(f"training failed: {one_line(exc)}; an error in the code or the installation is not "
                             f"restarted (a relaunch would meet it again); {resume}") from exc
    if bad_value(exc):
        resume = _can_resume(_resume_point(ck, expected_fp))
        raise TrainingFailed(f"training failed: {one_line(exc)}; a bad setting or value (ValueError) is not "
                             f"restarted (a relaunch gets the same config); {resume}") from exc
    raise exc


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
