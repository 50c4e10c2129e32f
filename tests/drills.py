"""The fault drills of the feature and shard stages: one stage run three times in a retrying Spark
process (tests/spark_process.py): clean, with the first attempt of every task killed mid-file,
and with it failing after its first file; each run reports its committed output and the task
attempts that failed, and the faulty runs must give the clean run's output."""
from __future__ import annotations

import os

from spark_process import run_drills

FAULTS = (("clean", None), ("killed", "mid:exit"), ("failed", "after:raise"))


def failed_tasks(spark) -> int:
    """Task attempts that failed so far in the jobs of the session's current job group (the drill
    runner gives each call a group of its own)."""
    sc = spark.sparkContext
    tracker = sc.statusTracker()
    group = sc.getLocalProperty("spark.jobGroup.id")
    stages = {s for j in tracker.getJobIdsForGroup(group) for s in (tracker.getJobInfo(j).stageIds or [])}
    return sum(info.numFailedTasks for info in map(tracker.getStageInfo, stages) if info is not None)


def drill(call: str, base: dict, root, min_failed: int) -> dict:
    """Run ``call`` (``module:function(spark, **kwargs)`` returning a dict with ``failed_tasks``)
    on ``base`` + ``output`` under each fault; asserts every faulty run failed at least
    ``min_failed`` attempts and returned the clean run's result; returns that result."""
    calls = [{"call": call, "kwargs": {**base, "output": str(root / name)}, "fault": fault} for name, fault in FAULTS]
    clean, killed, failed = run_drills(calls)
    assert "result" in clean, clean
    want = clean["result"]
    assert want.pop("failed_tasks") == 0
    for got in (killed, failed):
        assert "result" in got, got
        assert got["result"].pop("failed_tasks") >= min_failed
        assert got["result"] == want
    assert not [p for p in os.listdir(root) if p.startswith(".")]          # no job prefix left
    return want
