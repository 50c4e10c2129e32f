"""The feature stage's Delta tables (``output_format: delta``, pipeline.tables.tables_job.TablesJob) without
Spark: a run stopped between its tables' log entries is reported and replaced by the next run, a
stopped run's prefix under ``_pipeline/jobs/`` is deleted, and every log entry's ``stats`` is the
files' row count or absent (never ``""``)."""
from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from delta_drills import commit_sources
from tables_drills import KILLED, run_drill, write_tables

from pipeline.errors import BadInputError
from pipeline.fs import location
from pipeline.inputs import dataset_files
from pipeline.tables.tables_job import torn_tables
from pipeline.tables.snapshot import snapshot_files

TABLES = ("hlf", "llf")


def _runs(table) -> list[int]:
    """The ``run`` values of the newest snapshot of ``table``."""
    return sorted(set(pq.ParquetDataset(snapshot_files(str(table))).read().column("run").to_pylist()))


def _adds(table) -> list[dict]:
    return [a["add"] for f in sorted((table / "_delta_log").glob("*.json"))
            for a in map(json.loads, f.read_text().splitlines()) if "add" in a]


def test_a_run_stopped_between_its_tables_is_reported_and_replaced(tmp_path, monkeypatch, capsys):
    """A run stopped after each commit step in turn until one stops between hlf/'s log entry and
    llf/'s: torn_tables names both versions, the next run prints that line, commits both tables and
    deletes what the stopped run left under every ``_pipeline/jobs/``. Until then a reader of either
table's newest version stops with that line (the ``scaling.json`` beside them is the older run's)."""
    import pipeline.tables.job as job_mod

    out = tmp_path / "features"
    write_tables(str(out), 1)
    assert torn_tables(location(str(out)), TABLES) is None
    line = None
    for kill in range(1, 10):
        assert run_drill(str(out), 2, kill) == KILLED, kill     # the torn state comes before the last step
        if _runs(out / "hlf") == [2]:
            assert _runs(out / "llf") == [1], kill
            line = torn_tables(location(str(out)), TABLES)
            break
        assert torn_tables(location(str(out)), TABLES) is None, kill
    assert line is not None and line.startswith(f"{out}: a run stopped between its tables' commits: hlf/ at "
                                                "version 1 (run "), line
    assert "llf/ at version 0 (run " in line
    for t in TABLES:               # a reader of either table's newest version (the shard stage, training)
        with pytest.raises(BadInputError, match=re.escape(f"{line}: rerun the stage that wrote them")):
            dataset_files(str(out / t))
    assert len(dataset_files(str(out / "hlf"), version=0)) == 1     # one run's version still reads
    assert json.loads((out / "report.json").read_text()) == {"rows": 1}
    assert any((out / "_pipeline" / "jobs").iterdir())            # the stopped runs' prefixes
    monkeypatch.setattr(job_mod, "STALE_S", -60)                  # every other job's prefix counts as stopped
    write_tables(str(out), 3)
    assert f"{line}; this run replaces them all" in capsys.readouterr().out
    assert (_runs(out / "hlf"), _runs(out / "llf")) == ([3], [3])
    assert torn_tables(location(str(out)), TABLES) is None
    assert all(len(dataset_files(str(out / t))) == 1 for t in TABLES)
    for d in (out, out / "hlf", out / "llf"):
        jobs = d / "_pipeline" / "jobs"
        assert not jobs.exists() or not any(jobs.iterdir()), d


def test_log_entries_carry_row_counts_or_no_stats(tmp_path):
    """The feature tables' entries say each file's rows (numRecords); an entry whose rows the
    writer does not know has no ``stats`` (delta-rs and Spark read ``""`` as broken stats)."""
    out = tmp_path / "features"
    write_tables(str(out), 2)
    for t in TABLES:
        assert [json.loads(a["stats"])["numRecords"] for a in _adds(out / t)] == [2]
    table = tmp_path / "t"
    job = commit_sources(str(table), ["a.root"], begin_only=True)
    job.rows = {}
    job.commit()
    adds = _adds(table)
    assert len(adds) == 1 and adds[0].get("stats") is None
