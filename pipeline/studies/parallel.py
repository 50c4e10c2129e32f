"""A study's runs trained several at a time (``parallel_runs``): each run in a process of its own,
the processes started once and reused by the following runs.

Only runs on the ``inprocess`` launcher run this way (its ranks are threads of one process, one torch
thread in all): on 2 cores one such run leaves a core mostly idle, so two at once finish a batch of
runs about 1.6x sooner (docs/benchmarks.md, "The studies' cost"). A run trains exactly as it would
alone (the same seed gives the same digests); the driver prepares its data and run folder before,
and records it after, in the study's order. A pool process ends when the driver's process is gone
(a study stopped with ``kill`` between sittings leaves no run training on as an orphan).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


def _train(cfg_json: str) -> tuple[dict, float, int]:
    """In a pool process: train one run; returns its summary, its seconds and the process id."""
    from ..train.config import TrainConfig
    from ..train.launch import train

    t0 = time.time()
    summary = train(TrainConfig.model_validate_json(cfg_json))
    return summary, time.time() - t0, os.getpid()


#: seconds between a pool process's checks that the driver is still there
PARENT_POLL_S = 1.0


def _watch_parent(parent_pid: int) -> None:
    """A pool process's initializer: a thread that ends the process once its parent (the study's
    driver) is gone; the process is then a child of another (init or a subreaper)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


class RunPool:
    """``n`` processes (started with ``spawn``: no state of the driver, no Spark, is inherited),
    each running ``target`` on a run's config JSON. A process that dies (killed, out of memory)
    fails the runs it held; the next run starts ``n`` new processes."""

    def __init__(self, n: int, target: Callable[[str], object] = _train) -> None:
        self.n = n
        self._target = target
        self._pool = self._start()

    def _start(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(max_workers=self.n, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_watch_parent, initargs=(os.getpid(),))

    def submit(self, train_cfg) -> cf.Future:
        cfg_json = train_cfg.model_dump_json()
        try:
            return self._pool.submit(self._target, cfg_json)
        except cf.process.BrokenProcessPool:
            log.warning("a run's process died; starting %d new run process(es)", self.n)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._start()
            return self._pool.submit(self._target, cfg_json)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
