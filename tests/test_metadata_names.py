"""Names read from the pipeline's own metadata (a ``_COMPLETE`` marker's ``files`` and ``objects``,
a stopped job's ``_moving.json``) never lead outside their output: one line, and nothing is read or
deleted through them (pipeline.fs.confined), on a local disk and on the S3 server (loopback)."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delta_drills import commit_sources
from store_fixtures import s3, store_root  # noqa: F401 - the S3 server fixtures

from pipeline.committed import committed_files, resolve
from pipeline.errors import BadInputError
from pipeline.fs import confined, exists, location, write_bytes
from pipeline.tables import deltalog

STALE, OTHER = "abcdef012345", "0123456789ab"


def _parquet(loc: str) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"x": [1]}), buf)
    write_bytes(location(loc), buf.getvalue())


def test_confined_names(tmp_path):
    root = location(str(tmp_path / "out"))
    assert confined(root, "hlf/./part-0.parquet", "m") == root.child("hlf/part-0.parquet")
    assert confined(root, "a/../b", "m") == root.child("b")
    for bad in ("../x", "a/../../x", "/etc/passwd", "s3://other/x", "", ".", "..", "~/x", "a\x00b", None, 3,
                ["x"]):
        with pytest.raises(BadInputError, match=r"^m: names .* which is not inside "):
            confined(root, bad, "m")
    s3root = location("s3://bucket/prefix/out")
    assert str(confined(s3root, "p/x.parquet", "m")) == "s3://bucket/prefix/out/p/x.parquet"
    with pytest.raises(BadInputError, match="not inside s3://bucket/prefix/out"):
        confined(s3root, "../../../other-bucket/x", "m")


def test_a_stale_jobs_moving_list_deletes_nothing_outside_its_table(store_root, monkeypatch):
    """A stopped job's ``_moving.json`` naming a file beside the table (``../``) or an absolute path:
    the next job's begin() stops with one line naming the list and deletes nothing (neither that
    file nor another stopped job's files); once the bad prefix is gone the clean-up works again."""
    import pipeline.tables.job as job_mod

    monkeypatch.setattr(job_mod, "STALE_S", -60)      # every other job's prefix counts as stopped
    table = f"{store_root}/table"
    commit_sources(table, ["a.root"])
    victim = f"{store_root}/victim-{STALE}.parquet"
    _parquet(victim)
    mine = f"{table}/part-00000-c00000-{OTHER}.parquet"     # a stopped job's own file: deleted once allowed
    _parquet(mine)
    write_bytes(location(f"{table}/_pipeline/jobs/{OTHER}/_moving.json"),
                json.dumps([f"part-00000-c00000-{OTHER}.parquet"]).encode())
    absolute = ("/" + location(victim).path) if store_root.startswith("s3://") else location(victim).path
    for names in (["../" + location(victim).name], [absolute]):
        write_bytes(location(f"{table}/_pipeline/jobs/{STALE}/_moving.json"), json.dumps(names).encode())
        with pytest.raises(BadInputError, match=rf"{STALE}/_moving\.json: names '{names[0]}', which is not inside"):
            job_mod.DeltaJob(table).begin()
        assert exists(location(victim)) and exists(location(mine))
        assert exists(location(f"{table}/_pipeline/jobs/{OTHER}/_moving.json"))
    write_bytes(location(f"{table}/_pipeline/jobs/{STALE}/_moving.json"),
                json.dumps([f"part-00001-c00000-{STALE}.parquet"]).encode())
    job_mod.DeltaJob(table).begin().abort()
    assert exists(location(victim)) and not exists(location(mine))
    assert not exists(location(f"{table}/_pipeline/jobs/{STALE}"))
    assert deltalog.snapshot(location(table)).version == 0


@pytest.mark.parametrize("body", [
    {"files": ["part-0.parquet"], "objects": {"part-0.parquet": "../secret.parquet"}},
    {"files": ["../secret.parquet"]},
    {"files": ["part-0.parquet"], "objects": {"part-0.parquet": f"../.out.tmp-{OTHER}/../secret.parquet"}},
    {"files": ["part-0.parquet"], "objects": {"part-0.parquet": "/secret.parquet"}},
], ids=["objects", "files", "staging-climb", "absolute"])
def test_a_marker_naming_a_file_outside_its_output_is_refused(store_root, body):
    """A ``_COMPLETE`` whose ``files`` or ``objects`` lead outside the output (beside it, through
    the staging prefix, absolute): the readers stop with one line naming the marker."""
    out, secret = f"{store_root}/out", f"{store_root}/secret.parquet"
    _parquet(secret)
    _parquet(f"{out}/part-0.parquet")
    write_bytes(location(f"{out}/_COMPLETE"), json.dumps({"format": 2, "job": STALE, **body}).encode())
    with pytest.raises(BadInputError, match=r"out/_COMPLETE: names '.*secret\.parquet', which is not inside"):
        committed_files(out, ".parquet")
    if store_root.startswith("s3://"):
        with pytest.raises(BadInputError, match=r"out/_COMPLETE: names"):
            resolve(f"{out}/part-0.parquet")


def test_a_marker_naming_its_jobs_staging_prefix_is_read_there(store_root):
    """The one place outside the output a marker may name: its own job's staging prefix beside it
    (a commit on an object store under way)."""
    out = f"{store_root}/out"
    rel = f"../.out.tmp-{STALE}/_attempts/s1-p0-a0-t0/part-0.parquet"
    _parquet(f"{store_root}/.out.tmp-{STALE}/_attempts/s1-p0-a0-t0/part-0.parquet")
    write_bytes(location(f"{out}/_COMPLETE"), json.dumps(
        {"format": 2, "job": STALE, "files": ["part-0.parquet"], "objects": {"part-0.parquet": rel}}).encode())
    got = committed_files(out, ".parquet")
    assert [str(g) for g in got] == [f"{store_root}/.out.tmp-{STALE}/_attempts/s1-p0-a0-t0/part-0.parquet"]


def test_a_delta_log_naming_a_file_outside_its_table_is_refused(store_root):
    """A log entry adding ``../victim.parquet``: the snapshot's readers stop with one line."""
    from pipeline.tables.snapshot import snapshot_files

    _parquet(f"{store_root}/victim.parquet")
    table = location(f"{store_root}/table")
    deltalog.commit(table, None, [{"path": "../victim.parquet", "size": 1, "rows": 1}], [],
                    pa.schema([("x", pa.int64())]), [], {"stage": "test"})
    with pytest.raises(BadInputError, match=r"table/_delta_log: names '\.\./victim\.parquet', which is not inside"):
        snapshot_files(str(table))
