"""Run jobs in a fresh Python process with a local Spark session of its own.

The suite's shared session (``local[2]``) fails a job at the first failed task; the fault drills
need a master that retries tasks (``local[2,4]``: 2 slots, 4 attempts per task). ``run_drills``
starts one such process, which runs a list of calls (``module:function`` + keyword arguments,
each called as ``function(spark, **kwargs)``), each optionally under a fault of the commit
protocol (the job's local property ``pipeline.test.fault``), and returns their results (JSON) or
their one-line errors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def run_drills(calls: list[dict], *, master: str = "local[2,4]", env: dict | None = None,
               timeout: float = 600) -> list[dict]:
    """``calls``: ``{"call": "module:function", "kwargs": {...}, "fault": "mid:exit" | None}``;
    returns per call ``{"result": ...}`` or ``{"error": "<type>: <message>"}``."""
    penv = {**os.environ, **(env or {})}
    penv["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), penv.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, __file__, json.dumps({"master": master, "calls": calls})], env=penv,
                       cwd=str(REPO), capture_output=True, text=True, timeout=timeout)
    lines = [x for x in r.stdout.splitlines() if x.startswith("DRILLS ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"drill process failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return json.loads(lines[-1][len("DRILLS "):])


def _main(request: dict) -> list[dict]:
    import importlib

    from pipeline.commit import FAULT_PROPERTY
    from pipeline.config import SparkConfig
    from pipeline.spark import get_spark

    spark = get_spark(SparkConfig(master=request["master"], app_name="fault-drills", driver_memory="1g",
                                  shuffle_partitions=2))
    sc = spark.sparkContext
    out = []
    for call in request["calls"]:
        module, name = call["call"].split(":")
        fn = getattr(importlib.import_module(module), name)
        sc.setLocalProperty(FAULT_PROPERTY, call.get("fault"))
        try:
            out.append({"result": fn(spark, **call.get("kwargs", {}))})
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append({"error": f"{type(e).__name__}: {e}"})
        finally:
            sc.setLocalProperty(FAULT_PROPERTY, None)
    spark.stop()
    return out


if __name__ == "__main__":
    print("DRILLS " + json.dumps(_main(json.loads(sys.argv[1]))), flush=True)
