"""Kill-and-resume under the Spark launchers: a Horovod-on-Spark worker and a TorchDistributor
worker are SIGKILLed mid-run; the training stage relaunches the workers from the newest complete
checkpoint and the run ends like the uninterrupted one. M = 4 with the local launcher."""
from __future__ import annotations

import json
import time

import pytest

from pipeline.train.config import TrainConfig
from pipeline.train.launch import train

from train_fixtures import inprocess_reference

pytest_plugins = ["train_fixtures"]
pytestmark = [pytest.mark.cluster, pytest.mark.slow,
              # horovod.spark's background thread reports the Spark job it cancels after the kill
              pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")]

KILL = {"fail_at_step": 7, "fail_rank": 1, "fail_mode": "kill"}


def _shards(tmp_path, workers):
    from train_fixtures import write_digit_shards

    return write_digit_shards(tmp_path / "shards", workers=workers, n_train=64 * workers, n_test=64, n_val=32,
                              row_group_rows=32)


def _base(man, **kw):
    # stall_timeout: a survivor blocked on its killed peer is ended (and counted as the same failure)
    d = dict(manifest=str(man), epochs=2, batch_size=16, optimizer="sgd", lr=0.05, checkpoint_every=3,
             progress=False, algorithm={"name": "arsgd"}, stall_timeout=60)
    d.update(kw)
    return d


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """2-worker shards and the uninterrupted run, trained once for the module in this process
    (``inprocess_reference``): the kill drill of each Spark launcher and the Horovod hang drill compare
    with it (``stall_timeout`` only bounds a wait for a dead peer; it changes no step of a run that has none)."""
    root = tmp_path_factory.mktemp("two-workers")
    man = _shards(root, 2)
    ref = inprocess_reference(TrainConfig(output=str(root / "ref"), **_base(man)))
    return man, ref


def _check_restart(run: dict, ref: dict, worker, from_step: int) -> None:
    (r,) = run["restarts"]
    assert r["from_step"] == from_step and r["checkpoint"].endswith(f"step_{from_step:08d}")
    if worker is not None:
        assert r["worker"] == worker
    assert run["steps"] == ref["steps"]
    assert run["final_digests"] == ref["final_digests"]
    assert abs(run["test_accuracy"] - ref["test_accuracy"]) <= 0.003
    recs = [json.loads(x) for x in open(run["metrics"]).read().splitlines()]
    assert sum(m["kind"] == "restart" for m in recs) == 1


@pytest.mark.timeout(600)  # about 30 s; a survivor blocked on its dead peer is ended after stall_timeout
@pytest.mark.parametrize("launcher", [pytest.param("horovod", marks=pytest.mark.needs_horovod), "torch"])
def test_a_killed_spark_worker_is_relaunched_from_the_newest_checkpoint(spark, two_workers, tmp_path, launcher):
    man, ref = two_workers
    base = _base(man, launcher=launcher)
    run = train(TrainConfig(output=str(tmp_path / "run"), debug=KILL, **base), spark)
    _check_restart(run, ref, None, 6)


@pytest.mark.timeout(900)
@pytest.mark.needs_horovod
def test_a_blocked_horovod_worker_is_ended_by_the_watchdog_and_the_run_relaunched(spark, two_workers, tmp_path):
    """Rank 1 blocks for good after step 7 (a deadlock); rank 0 then waits in its next allreduce.
    Both watchdogs end their processes after stall_timeout, Horovod reports the failed launch,
    and the relaunch from step 6 ends like the uninterrupted run."""
    man, ref = two_workers
    base = _base(man, launcher="horovod", stall_timeout=20)
    t0 = time.monotonic()
    run = train(TrainConfig(output=str(tmp_path / "run"), debug={**KILL, "fail_mode": "hang"}, **base), spark)
    _check_restart(run, ref, None, 6)
    assert "exit code: 75" in run["restarts"][0]["failure"].lower()
    assert time.monotonic() - t0 < 300


@pytest.mark.timeout(1500)
def test_four_local_workers_one_killed(tmp_path):
    man = _shards(tmp_path, 4)
    base = _base(man, launcher="local", algorithm={"name": "local_sgd", "params": {"period": 2}})
    ref = train(TrainConfig(output=str(tmp_path / "ref"), **base))
    run = train(TrainConfig(output=str(tmp_path / "run"), debug={**KILL, "fail_at_step": 5, "fail_rank": 3},
                            **base))
    _check_restart(run, ref, 3, 3)


@pytest.mark.parametrize("launcher", [pytest.param("horovod", marks=pytest.mark.needs_horovod), "torch"])
def test_a_spark_launch_fails_at_once_without_enough_task_slots(spark, tmp_path, launcher):
    from pipeline.errors import ConfigError

    man = _shards(tmp_path, 3)  # the session is local[2]: two task slots
    with pytest.raises(ConfigError, match="workers=3"):
        train(TrainConfig(output=str(tmp_path / "out"), **_base(man, launcher=launcher)), spark)
    assert not (tmp_path / "out").exists()
