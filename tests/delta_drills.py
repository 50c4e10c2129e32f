"""Delta commits without Spark, for the tests of tests/test_delta.py: a job (:class:`pipeline.tables.job.DeltaJob`)
whose task attempts each write one small Parquet file for one input ("source"), as ROOT ingestion's
tasks do, with the ledger record naming the inputs; :func:`run_drill` commits one in a process of its
own, stopped (``os._exit``) after the n-th step of its commit (``PIPELINE_TEST_COMMIT_KILL``), or with
a log entry whose outcome it does not see (``PIPELINE_TEST_LOG_FAULT``, :data:`pipeline.tables.deltalog.LOG_FAULTS`:
written, then a 412 on the retry, an error, or a stop).

Run as a script: ``python tests/delta_drills.py <table> <source>...``; exit 57 when stopped.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KILLED = 57


def commit_sources(table: str, sources: list[str], *, begin_only: bool = False, sample: str | None = None):
    """A job on ``table`` whose tasks wrote one file per source (a row ``{"source": name}``);
    committed unless ``begin_only`` (then returned ready to commit). ``sample``: the table is
    partitioned by ``sample`` and every file has this value."""
    import pyarrow as pa

    from pipeline.tables.job import DeltaJob

    job = DeltaJob(table, partition_by=("sample",) if sample is not None else ()).begin()
    records, rows = [], {}
    for i, src in enumerate(sources):
        attempt = job.target.attempt(stage=1, partition=i, attempt=0, task_attempt_id=i)
        rel = f"part-f{i:05d}-c00000.parquet"
        attempt.write_table(rel, pa.table({"source": [src]}))
        records.append(attempt.record())
        rows[rel] = 1
        if sample is not None:
            job.partition_values[rel] = {"sample": sample}
    job.add(records)
    job.rows = rows
    job.schema = pa.schema([pa.field("source", pa.string())])
    job.schema_source = sources[0]
    job.record = {"stage": "drill", "sources": [
        {"file": s, "size": 1, "mtime_ns": 1, "parts": [{"path": job.final_name(f"part-f{i:05d}-c00000.parquet"),
                                                        "rows": 1}]} for i, s in enumerate(sources)]}
    if begin_only:
        return job
    try:
        job.commit()
    except BaseException:
        job.abort()
        raise
    return job


def run_drill(table: str, sources: list[str], kill: int, fault: str = "") -> int:
    """Commit ``sources`` to ``table`` in a process of its own, stopped after step ``kill`` (0: never),
    with the log fault ``fault`` (``PIPELINE_TEST_LOG_FAULT``; "": none); its exit status (``exit``:
    1, the stop's ``SystemExit``)."""
    env = {**os.environ, "PIPELINE_TEST_COMMIT_KILL": str(kill), "PIPELINE_TEST_LOG_FAULT": fault,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, __file__, table, *sources], env=env, capture_output=True, text=True,
                       timeout=120)
    if r.returncode not in (0, KILLED) and not (fault == "exit" and "[commit drill] stopped after writing" in r.stderr):
        raise RuntimeError(f"drill process failed (exit {r.returncode}): {r.stderr[-3000:]}")
    return r.returncode


if __name__ == "__main__":
    commit_sources(sys.argv[1], sys.argv[2:])
