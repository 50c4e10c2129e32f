"""A feature-stage-like job on a folder of Delta tables without Spark, for tests/test_features_tables.py:
:class:`pipeline.tables.tables_job.TablesJob` writing ``hlf/`` and ``llf/`` (one small Parquet file each,
written by a task attempt as the writer tasks do) and ``report.json``; :func:`run_drill` runs one in
a process of its own, stopped (``os._exit``) after the n-th step of its commit.

Run as a script: ``python tests/tables_drills.py <output> <rows>``; exit 57 when stopped.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KILLED = 57


def write_tables(out: str, rows: int) -> str:
    """One run: ``rows`` rows in hlf/ and in llf/ (column ``run`` = rows); returns the job id."""
    import pyarrow as pa

    from pipeline.tables.tables_job import tables_job

    with tables_job(out, ("hlf", "llf"), "features") as job:
        records = []
        for i, name in enumerate(("hlf", "llf")):
            attempt = job.target.attempt(stage=1, partition=i, attempt=0, task_attempt_id=i)
            attempt.write_table(f"{name}/part-00000.parquet", pa.table({"run": [rows] * rows}))
            records.append(attempt.record())
        job.add(records)
        job.write_json("report.json", {"rows": rows})
    return job.job_id


def run_drill(out: str, rows: int, kill: int) -> int:
    """:func:`write_tables` in a process of its own, stopped after commit step ``kill``; its exit status."""
    env = {**os.environ, "PIPELINE_TEST_COMMIT_KILL": str(kill),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, __file__, out, str(rows)], env=env, capture_output=True, text=True,
                       timeout=120)
    if r.returncode not in (0, KILLED):
        raise RuntimeError(f"drill process failed (exit {r.returncode}): {r.stderr[-3000:]}")
    return r.returncode


if __name__ == "__main__":
    write_tables(sys.argv[1], int(sys.argv[2]))
