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
