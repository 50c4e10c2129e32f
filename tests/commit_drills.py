"""Commits stopped at every step: a process commits an output through :class:`pipeline.commit.OutputJob`
and is stopped (``os._exit``) right after its n-th step (``PIPELINE_TEST_COMMIT_KILL``); the test
then reads the output with the stage's own readers, which must find the old or the new output
complete, and a rerun must succeed.

A generation is ``{name: bytes}``: names ending in ``.parquet`` or ``.root`` are written by task
attempts (one attempt per file, as Spark tasks write them), the others by the driver, as the stages do.

Each commit runs in a process forked from a forkserver that imported the commit code once
(:func:`run_commit`); it exits 57 when stopped (``PIPELINE_TEST_COMMIT_KILL``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

KILLED = 57


TASK_FILES = (".parquet", ".root")


def commit_generation(out: str, files: dict[str, bytes]) -> None:
    from pipeline.commit import output_job

    with output_job(out) as job:
        records = []
        for i, (name, data) in enumerate(sorted(files.items())):
            if name.endswith(TASK_FILES):
                attempt = job.target.attempt(stage=1, partition=i, attempt=0, task_attempt_id=i)
                attempt.write_bytes(name, data)
                records.append(attempt.record())
        job.add(records)
        for name, data in sorted(files.items()):
            if not name.endswith(TASK_FILES):
                job.write_bytes(name, data)


_FORKSERVER = None


def _context():
    """The forkserver that starts the commit processes: a process that imported the commit code
    once; each commit is a fork of it (no interpreter start, no imports: a few ms instead of about a
    second), with no JVM, S3 client or thread of the test process in it."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing

        from pipeline.train.local_launchers import PRELOAD

        # one fork server per process, shared with the local launcher: its preload too, whichever starts it
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, "pyarrow.fs", "pyspark.sql", "pipeline.commit", "commit_drills"])
        _FORKSERVER = ctx
    return _FORKSERVER


def _commit_process(environ: dict, out: str, files: dict[str, bytes], err_path: str) -> None:
    """In the commit process: the test's environment (what a new process would inherit), then the
    commit; an error's traceback goes to ``err_path``."""
    os.environ.clear()
    os.environ.update(environ)
    try:
        commit_generation(out, files)
    except BaseException:
        import traceback

        Path(err_path).write_text(traceback.format_exc())
        os._exit(1)


def run_commit(out: str, files: dict[str, bytes], kill: int, env: dict, no_exchange: bool = False) -> int:
    """Commit ``files`` into ``out`` in a process of its own, stopped after step ``kill`` (0: never);
    its exit status (``KILLED`` when stopped)."""
    import tempfile

    penv = {**os.environ, **env}
    penv.pop("PIPELINE_TEST_COMMIT_KILL", None)
    penv.pop("PIPELINE_TEST_NO_EXCHANGE", None)
    if kill:
        penv["PIPELINE_TEST_COMMIT_KILL"] = str(kill)
    if no_exchange:
        penv["PIPELINE_TEST_NO_EXCHANGE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        err = os.path.join(tmp, "error.txt")
        proc = _context().Process(target=_commit_process, args=(penv, out, files, err))
        proc.start()
        proc.join(120)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise RuntimeError("commit process did not finish within 120 s")
        if proc.exitcode not in (0, KILLED):
            text = Path(err).read_text() if os.path.exists(err) else ""
            raise RuntimeError(f"commit process failed (exit {proc.exitcode}): {text[-3000:]}")
        return proc.exitcode


def drill_every_step(out: str, generations: tuple[dict, dict], check: Callable[[str], str], env: dict,
                     no_exchange: bool = False, max_steps: int = 400) -> list[str]:
    """Commit generation 0; then, for n = 1, 2, ... until a commit runs through: commit the other
    generation stopped after step n, ``check(out)`` (must name the old or the new generation: it
    raises when the output is neither or a mix), rerun that commit to the end (``check`` must name
    it). Returns what ``check`` saw after each stop."""
    assert run_commit(out, generations[0], 0, env, no_exchange) == 0
    current, seen = 0, []
    for n in range(1, max_steps):
        nxt = 1 - current
        rc = run_commit(out, generations[nxt], n, env, no_exchange)
        got = check(out)
        assert got in (str(current), str(nxt)), (n, got)
        if rc == 0:
            assert got == str(nxt), (n, got)
            return seen
        seen.append(got)
        assert run_commit(out, generations[nxt], 0, env, no_exchange) == 0, n
        assert check(out) == str(nxt), n
        current = nxt
    raise AssertionError(f"the commit did not finish within {max_steps} steps")

