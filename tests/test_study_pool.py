"""The study runner's pool of run processes (``parallel_runs``; pipeline/studies/parallel.py): a run
whose process dies is that run's failure, and the runs after it still train."""
from __future__ import annotations

import concurrent.futures.process as cfp
import os

import pytest

from pipeline.studies.parallel import RunPool


class _Cfg:
    """What the pool sends a process: a config's JSON (here a word the target acts on)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def model_dump_json(self) -> str:
        return self.text


def _die_or_echo(text: str) -> str:
    """A run's target in a pool process: ``die`` ends the process at once (as an OOM kill does)."""
    if text == "die":
        os._exit(3)
    return text


def test_a_run_whose_process_dies_fails_alone_and_the_next_run_gets_new_processes():
    pool = RunPool(1, target=_die_or_echo)
    try:
        assert pool.submit(_Cfg("before")).result(timeout=120) == "before"
        with pytest.raises(cfp.BrokenProcessPool):
            pool.submit(_Cfg("die")).result(timeout=120)
        assert pool.submit(_Cfg("after")).result(timeout=120) == "after"   # a broken pool refused it
    finally:
        pool.close()


_DRIVER = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
from test_study_pool import _Cfg, _sleep_and_tell
from pipeline.studies.parallel import RunPool

pool = RunPool(1, target=_sleep_and_tell)
pool.submit(_Cfg(sys.argv[2]))
time.sleep(600)
'''


def _sleep_and_tell(path: str) -> None:
    """A run that writes its process id and then trains for ten minutes."""
    import time

    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_stopped_study_leaves_no_run_process_behind(tmp_path):
    """`kill <driver>` (SIGTERM to the study's process, not to its group) between sittings: the run
    processes of its pool end too, instead of training on as orphans beside the next sitting."""
    import signal
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "run.pid"
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, os.path.dirname(__file__), str(pidfile)],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not pidfile.exists():
            assert driver.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.1)
        run_pid = int(pidfile.read_text())
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _alive(run_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(run_pid), f"run process {run_pid} outlived its study's process"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
