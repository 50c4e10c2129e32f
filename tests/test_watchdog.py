"""The worker watchdog (pipeline.train.watchdog) in real child processes: a stalled process ends
itself with the watchdog's exit status, its stacks and one line naming the rank; a process that
keeps beating runs on; a failed worker's cleanup is bounded; the C-level backstop ends a process
whose watch thread cannot run."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from pipeline.train.watchdog import EXIT_CODE

pytest_plugins = ["train_fixtures"]


def _child(body: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    code = "import time\nfrom pipeline.train.watchdog import Watchdog\n" + textwrap.dedent(body)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def test_a_stalled_process_ends_itself_with_its_stacks():
    p, secs = _child("""
        def blocked_in_a_collective():
            time.sleep(120)
        dog = Watchdog(1.5, rank=3, poll_s=0.1)
        blocked_in_a_collective()
        print("not reached")
    """)
    assert p.returncode == EXIT_CODE, p.stderr
    assert secs < 20
    assert "not reached" not in p.stdout
    assert "rank 3: worker stalled: no step, evaluation or checkpoint completed" in p.stderr
    assert "stall_timeout=1.5" in p.stderr
    assert "blocked_in_a_collective" in p.stderr  # the stacks say where it was stuck


def test_a_process_that_keeps_making_progress_runs_on_and_stops_the_watch():
    p, _ = _child("""
        dog = Watchdog(1.0, rank=0, poll_s=0.1)
        for _ in range(40):  # 4 s of steps, each well inside the timeout
            time.sleep(0.1)
            dog.beat()
        dog.stop()
        time.sleep(2.0)  # after stop(): no watch
        print("finished")
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "finished"
    assert "stalled" not in p.stderr


def test_a_failed_workers_cleanup_is_bounded():
    p, secs = _child("""
        import threading
        dog = Watchdog(600, rank=1, poll_s=0.1)
        dog.failing(grace_s=1.0)
        def stuck_cleanup():
            threading.Event().wait()
        stuck_cleanup()
    """)
    assert p.returncode == EXIT_CODE, p.stderr
    assert secs < 20  # 1 s grace, not the 600 s stall timeout
    assert "rank 1: worker stalled: its cleanup after a failure did not finish within 1 s" in p.stderr
    assert "stuck_cleanup" in p.stderr


def test_the_backstop_ends_a_process_whose_watch_thread_cannot_run():
    # catastrophic regex backtracking is one C call holding the GIL: the Python watch thread never runs
    p, secs = _child("""
        import re
        dog = Watchdog(1.0, rank=2, poll_s=0.1, backstop_s=1.0)
        re.match(r"(a+)+$", "a" * 64 + "b")
    """)
    assert p.returncode == 1, p.stderr  # faulthandler's exit status
    assert secs < 30
    assert "Timeout (0:00:02)!" in p.stderr
    assert "worker stalled" not in p.stderr


def test_no_watch_when_the_timeout_is_zero():
    p, _ = _child("""
        dog = Watchdog(0, rank=0, poll_s=0.05)
        dog.failing(grace_s=0.1)
        time.sleep(1.0)
        dog.beat(); dog.stop()
        print("alive")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "alive", p.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,skip", [("memory", 0), ("stream", 30)])
def test_a_worker_opening_a_slow_shard_beats_while_it_loads(tmp_path, mode, skip):
    """A shard that takes longer to decode (memory mode: all of it when the reader opens) or to
    skip into (a stream-mode resume decodes every skipped batch) than ``stall_timeout`` is not a
    stall: the reader beats per decoded row group. The decode is slowed in the child to 12 ms per
    row (32 row groups of 8 rows: about 3 s against a 1.5 s stall timeout)."""
    from train_fixtures import write_digit_shards

    man = write_digit_shards(tmp_path / "shards", workers=1, n_train=256, n_test=32, n_val=32, row_group_rows=8)
    p, _ = _child(f"""
        import torch
        import pipeline.data.engines as L
        from pipeline.train.comm.local import LocalCommunicator
        from pipeline.train.config import TrainConfig
        from pipeline.train.launch import make_plan
        from pipeline.train.worker import Worker

        decode = L.decode_table
        def slow_decode(table, *a, **k):  # a large shard on a slow disk
            time.sleep(0.012 * table.num_rows)
            return decode(table, *a, **k)
        L.decode_table = slow_decode
        cfg = TrainConfig(manifest={str(man)!r}, output={str(tmp_path / "o")!r}, launcher="local", batch_size=8,
                          progress=False, stall_timeout=1.5, loader={{"mode": {mode!r}, "decode_threads": 1}})
        plan = {{**make_plan(cfg), "resume_from": None}}
        w = Worker(cfg, LocalCommunicator(), plan, {str(tmp_path)!r}, {str(tmp_path / "ck")!r},
                   torch.device("cpu"))
        dog = Watchdog(cfg.stall_timeout, rank=0, poll_s=0.1)  # armed after the imports of building a worker
        w.beat = dog.beat  # what Worker(..., watchdog=dog) sets
        with w.batches(0, skip={skip}) as batches:
            n = sum(1 for _ in batches)
        dog.stop()
        print("batches", n)
    """, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["batches", str(32 - skip)]
    assert "stalled" not in p.stderr
