"""Commits stopped at every step: a process commits an output through :class:`pipeline.commit.OutputJob`
and is stopped (``os._exit``) right after its n-th step (``PIPELINE_TEST_COMMIT_KILL``); the test
then reads the output with the stage's own readers, which must find the old or the new output
complete, and a rerun must succeed.

A generation is ``{name: bytes}``: names ending in ``.parquet`` or ``.root`` are written by task
attempts (one attempt per file, as Spark tasks write them), the others by the driver, as the stages do.

Run as a script: ``python tests/commit_drills.py`` with a JSON object on standard input: ``out``
and ``files`` (name -> base64); exit 57 when stopped (``PIPELINE_TEST_COMMIT_KILL``).
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
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


def run_commit(out: str, files: dict[str, bytes], kill: int, env: dict, no_exchange: bool = False) -> int:
    """Commit ``files`` into ``out`` in a process of its own, stopped after step ``kill`` (0: never);
    its exit status (``KILLED`` when stopped)."""
    penv = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    penv.pop("PIPELINE_TEST_COMMIT_KILL", None)
    penv.pop("PIPELINE_TEST_NO_EXCHANGE", None)
    if kill:
        penv["PIPELINE_TEST_COMMIT_KILL"] = str(kill)
    if no_exchange:
        penv["PIPELINE_TEST_NO_EXCHANGE"] = "1"
    payload = json.dumps({"out": out, "files": {k: base64.b64encode(v).decode() for k, v in files.items()}})
    r = subprocess.run([sys.executable, __file__], input=payload, env=penv, capture_output=True, text=True,
                       timeout=120)
    if r.returncode not in (0, KILLED):
        raise RuntimeError(f"commit process failed (exit {r.returncode}): {r.stderr[-3000:]}")
    return r.returncode


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


if __name__ == "__main__":
    req = json.loads(sys.stdin.read())
    commit_generation(req["out"], {k: base64.b64decode(v) for k, v in req["files"].items()})
