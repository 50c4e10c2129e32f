"""A file that always fails (issue 52, item 5): an only-new run on a table whose only new input is a
real truncated ROOT file. Each failed run is recorded in the table's log (a version that changes no
data), the run that reaches ``quarantine_after`` quarantines the file and does not fail for it,
later runs skip it in one line, ``--dry-run`` lists it, ``retry_quarantined`` tries it once more,
and a new upload of the file (another size) is tried again. No Spark: a file that cannot be opened
fails while the driver plans (the DAG test, tests/test_dags_daily.py, runs the same policy through
Spark tasks and Airflow retries)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import BadInputError
from pipeline.fs import location
from pipeline.ingest.root import IngestRootConfig, ingest_root
from pipeline.tables import deltalog, quarantine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def setup(tmp_path, delphes_root):
    """A one-version table, and a landing folder with a truncated copy of the Delphes file."""
    table = tmp_path / "table"
    table.mkdir()
    pq.write_table(pa.table({"x": [1]}), table / "part-0.parquet")
    deltalog.commit(location(str(table)), None, [{"path": "part-0.parquet",
                                                  "size": os.path.getsize(table / "part-0.parquet"), "rows": 1}],
                    [], pa.schema([("x", pa.int64())]), [], {"stage": "ingest_root", "sources": []})
    bad = tmp_path / "land" / "ttbar" / "cut.root"
    bad.parent.mkdir(parents=True)
    data = delphes_root.read_bytes()
    bad.write_bytes(data[: int(0.02 * len(data))])                       # the header only: it cannot be opened
    return table, bad, data


def _cfg(bad, table, **kw) -> IngestRootConfig:
    return IngestRootConfig(input=[str(bad)], tree="Delphes", output=str(table), output_format="delta",
                            mode="new_files", quarantine_after=2, **kw)


def test_a_file_that_always_fails_is_quarantined_skipped_listed_and_retried(setup, capsys):
    table, bad, data = setup
    loc = location(str(table))
    r = _job(bad, table)                                                  # failure 1 of 2: the run fails
    assert r.returncode == 2 and [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: 1 of 1 input file(s) failed (see the commit record of version 1); {bad}: "
        + deltalog.commits(loc)[-1][1]["bad_files"][0]["reason"]], r.stderr[-2000:]
    assert deltalog.commits(loc)[-1][1]["bad_files"][0]["file"] == str(bad)
    assert len(deltalog.snapshot(loc).files) == 1                        # no data changed

    r = _job(bad, table)                                                  # failure 2: quarantined, exit 0
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{bad}: quarantined after 2 failed run(s) (" in r.stdout
    v_q = deltalog.commits(loc)[-1][0]
    assert [q["file"] for q in deltalog.commits(loc)[-1][1]["quarantined"]] == [str(bad)]

    rep = ingest_root(_cfg(bad, table))                                   # skipped with one line: nothing new
    out = capsys.readouterr().out
    assert rep["nothing_new"] and rep["quarantined_skipped"] == [str(bad)]
    assert [ln for ln in out.splitlines() if str(bad) in ln] == [
        quarantine.skip_line(str(bad), quarantine.read_state(loc).quarantined({"file": str(bad),
                                                                             **_stat(bad)}))]
    assert f"quarantined at version {v_q} after 2 failed run(s)" in out
    assert deltalog.commits(loc)[-1][0] == v_q                            # the skipping run committed nothing

    r = _job(bad, table, "--dry-run")                                      # listed by the dry run of the command
    assert r.returncode == 0, r.stderr[-2000:]
    listed = json.loads(r.stdout)["plan"]["quarantined"]
    assert [(q["file"], q["failures"], q["version"]) for q in listed] == [(str(bad), 2, v_q)]

    # retried on request: one try; failing again quarantines it again at once (the run does not fail)
    rep = ingest_root(_cfg(bad, table, retry_quarantined=True))
    assert [q["failures"] for q in rep["quarantined"]] == [3]

    # a new upload (another size) is a new file: tried again, counted from one
    bad.write_bytes(data[: int(0.03 * len(data))])
    with pytest.raises(BadInputError, match="cut.root"):
        ingest_root(_cfg(bad, table))
    assert quarantine.read_state(loc).failures(_stat(bad) | {"file": str(bad)}) == 1


def _job(bad, table, *more) -> subprocess.CompletedProcess:
    """``jobs/ingest_root.py`` as a user runs it (its exit status and lines)."""
    return subprocess.run([sys.executable, "-m", "jobs.ingest_root", "--input", str(bad), "--output", str(table),
                           "--set", "output_format=delta", "--set", "mode=new_files", "--set", "tree=Delphes",
                           "--set", "quarantine_after=2", *more], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


def _stat(p) -> dict:
    from pipeline.tables.ledger import source_stat

    return source_stat(str(p))
