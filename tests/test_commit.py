"""The commit protocol of outputs written by Spark tasks (pipeline/commit.py): tasks write under a
job-scoped prefix with attempt-scoped names, the driver commits exactly the attempts Spark kept.

On a local path and on a real S3 server (moto, loopback): the commit itself with losing and
partial attempts left behind, the refusals, and fault drills in a Spark session that retries tasks
(``local[2,4]``, a process of its own): the first attempt of every task is killed (``os._exit``
of the Python worker) or fails, mid-write or after a complete file, and the committed output must
hold exactly the rows, once each, in readable files.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import fs
from pipeline.commit import (ATTEMPT_DDL, ATTEMPTS, COMPLETE_MARKER, JobTarget, OutputJob, attempt_schema,
                             output_job)
from pipeline.committed import committed_files, require_complete
from pipeline.errors import BadInputError, PipelineError
from servers import environment
from store_fixtures import s3, store_root  # noqa: F401
from spark_process import run_drills

ROWS, PARTS = 400, 4


def _names(uri: str) -> list[str]:
    loc = fs.location(uri)
    return [os.path.relpath(f.path, loc.path) for f in fs.list_files(loc)]


def _table(lo: int, hi: int) -> pa.Table:
    return pa.table({"id": pa.array(range(lo, hi), pa.int64())})


def _read_ids(uri: str) -> list[int]:
    ids: list[int] = []
    for f in committed_files(uri, ".parquet"):
        with f.filesystem().open_input_file(f.path) as fh:
            ids.extend(pq.read_table(fh).column("id").to_pylist())
    return ids


def test_commit_keeps_the_reported_attempts_only(store_root):
    """Two attempts of task 0 (the loser's file complete, one more half-written file), one of task 1:
    the committed output holds the reported attempts' files under their output names, the driver's
    file, nothing of the other attempts, and no job prefix is left beside it."""
    out = f"{store_root}/out"
    with output_job(out) as job:
        loser = job.target.attempt(stage=3, partition=0, attempt=0, task_attempt_id=10)
        loser.write_table("part-00000.parquet", _table(0, 50))
        loser.write_bytes("part-00000-extra.bin", b"half a fi")
        winner = job.target.attempt(stage=3, partition=0, attempt=1, task_attempt_id=12)
        winner.write_table("part-00000.parquet", _table(0, 100))
        other = job.target.attempt(stage=3, partition=1, attempt=0, task_attempt_id=11)
        other.write_table("sub/part-00001.parquet", _table(100, 200))
        other.write_bytes("sub/dropped.bin", b"x")
        other.discard("sub/dropped.bin")
        job.add([winner.record(), other.record()])
        job.write_json("_report.json", {"rows": 200})
        assert fs.exists(fs.location(loser.location("part-00000.parquet")))   # still there before the commit
    expected = ["_report.json", "part-00000.parquet", "sub/part-00001.parquet"]
    assert _names(out) == sorted(expected + [COMPLETE_MARKER])
    assert sorted(_read_ids(out)) == list(range(200))
    assert [os.path.relpath(f.path, fs.location(out).path) for f in committed_files(out)] == expected[1:]
    assert _names(store_root) == [f"out/{n}" for n in _names(out)]                  # no job prefix, no attempts
    marker = json.loads(fs.read_bytes(fs.location(out).child(COMPLETE_MARKER)))
    assert marker["files"] == expected and "objects" not in marker


def test_commit_replaces_the_previous_output_and_a_failure_keeps_it(store_root):
    """A second commit replaces the first; a failure in the job body, and a failure inside the
    commit itself (a kept file gone from the job's prefix when the commit moves it), keep the
    previous output whole and readable."""
    out = f"{store_root}/out"
    with output_job(out) as job:
        a = job.target.attempt(stage=0, partition=0, attempt=0, task_attempt_id=0)
        a.write_table("part-00000.parquet", _table(0, 10))
        job.add([a.record()])
    with output_job(out) as job:
        a = job.target.attempt(stage=0, partition=0, attempt=0, task_attempt_id=0)
        a.write_table("part-new.parquet", _table(10, 20))
        job.add([a.record()])
    assert _read_ids(out) == list(range(10, 20))
    before = {n: fs.read_bytes(fs.location(out).child(n)) for n in _names(out)}
    with pytest.raises(RuntimeError, match="boom"):
        with output_job(out) as job:
            a = job.target.attempt(stage=0, partition=0, attempt=0, task_attempt_id=0)
            a.write_table("part-00000.parquet", _table(0, 5))
            job.add([a.record()])
            raise RuntimeError("boom")
    assert {n: fs.read_bytes(fs.location(out).child(n)) for n in _names(out)} == before
    assert _names(store_root) == [f"out/{n}" for n in sorted(before)]
    with pytest.raises((OSError, BadInputError)):
        with output_job(out) as job:
            a = job.target.attempt(stage=0, partition=0, attempt=0, task_attempt_id=0)
            a.write_table("part-00000.parquet", _table(0, 5))
            b = job.target.attempt(stage=0, partition=1, attempt=0, task_attempt_id=1)
            b.write_table("part-00001.parquet", _table(5, 9))
            job.add([a.record(), b.record()])
            fs.delete_file(job.kept()["part-00001.parquet"])     # the commit fails on this file
    ids = sorted(_read_ids(out))
    assert ids in (list(range(10, 20)), list(range(0, 9))), ids    # the old output, or the new one whole
    if fs.location(out).is_local:
        assert {n: fs.read_bytes(fs.location(out).child(n)) for n in _names(out)} == before
    with output_job(out) as job:                                    # the next run succeeds and cleans up
        job.write_bytes("a.txt", b"a")
    assert _names(store_root) == ["out/_COMPLETE", "out/a.txt"]


def test_a_stray_object_beside_a_committed_output_is_not_read(s3, tmp_path):
    """Readers of an object store trust the marker's list: an object a zombie attempt (or anyone)
    put under the prefix after the commit is not one of the dataset's files."""
    with environment(**s3.env("writer")):
        out = f"s3://{s3.bucket}/stray/out"
        with output_job(out) as job:
            a = job.target.attempt(stage=0, partition=0, attempt=0, task_attempt_id=0)
            a.write_table("part-00000.parquet", _table(0, 10))
            job.add([a.record()])
        fs.write_bytes(fs.location(out).child("part-00000-zombie.parquet"), b"PAR1 half")
        pq.write_table(_table(50, 60), f"{s3.bucket}/stray/out/part-00001.parquet",
                       filesystem=fs.location(out).filesystem())                # a stray, complete and valid
        assert [f.name for f in committed_files(out, ".parquet")] == ["part-00000.parquet"]
        assert _read_ids(out) == list(range(10))
        from pipeline.data.parquet import parquet_files
        from pipeline.inputs import dataset_files

        assert parquet_files(out) == dataset_files(out) == [f"{out}/part-00000.parquet"]   # the readers
        marker = fs.location(out).child(COMPLETE_MARKER)
        marker.filesystem().delete_file(marker.path)
        with pytest.raises(BadInputError, match="incomplete"):
            committed_files(out)


def test_a_dataset_inside_a_committed_output_is_read_by_the_enclosing_marker(s3):
    """A job that writes several datasets (the feature stage's hlf/ and llf/) commits one marker at
    its root: a reader of one dataset finds it, takes that dataset's files only, and still refuses
    one whose job was never committed."""
    with environment(**s3.env("writer")):
        out = f"s3://{s3.bucket}/nested/features"
        with output_job(out) as job:
            for i, name in enumerate(("hlf", "llf")):
                a = job.target.attempt(stage=0, partition=i, attempt=0, task_attempt_id=i)
                a.write_table(f"{name}/part-00000.parquet", _table(10 * i, 10 * i + 10))
                job.add([a.record()])
        hlf = f"{out}/hlf"
        assert require_complete(hlf) == fs.location(hlf)
        assert [str(f) for f in committed_files(hlf, ".parquet")] == [f"{hlf}/part-00000.parquet"]
        fs.write_bytes(fs.location(f"s3://{s3.bucket}/nested/other/hlf/part-00000.parquet"), b"PAR1 half")
        with pytest.raises(BadInputError, match="incomplete"):
            committed_files(f"s3://{s3.bucket}/nested/other/hlf")


def test_add_refuses_two_attempts_of_a_task_and_a_name_written_twice(tmp_path):
    with pytest.raises(PipelineError, match="two attempts of task"):
        with output_job(tmp_path / "a") as job:
            x = [job.target.attempt(stage=1, partition=0, attempt=n, task_attempt_id=n) for n in (0, 1)]
            for a in x:
                a.write_bytes("f.bin", b"x")
            job.add([a.record() for a in x])
    with pytest.raises(PipelineError, match="f.bin was written twice"):
        with output_job(tmp_path / "b") as job:
            x = [job.target.attempt(stage=1, partition=p, attempt=0, task_attempt_id=p) for p in (0, 1)]
            for a in x:
                a.write_bytes("f.bin", b"x")
            job.add([a.record() for a in x])
    for bad in ("../escape.bin", "/abs.bin", f"{ATTEMPTS}/x.bin", COMPLETE_MARKER):
        with pytest.raises(ValueError, match="not a file name inside an output"):
            JobTarget(str(tmp_path / ".t")).attempt(stage=0, partition=0, attempt=0, task_attempt_id=0).location(bad)
    assert sorted(os.listdir(tmp_path)) == []                                # both jobs aborted, nothing left


def test_overwrite_false_refuses_an_existing_output(store_root):
    out = f"{store_root}/out"
    with output_job(out) as job:
        job.write_bytes("a.txt", b"a")
    with pytest.raises(BadInputError, match="output already exists"):
        OutputJob(out, overwrite=False).begin()


def _put(loc: fs.Location, names: list[str]) -> None:
    for n in names:
        fs.write_bytes(loc.child(n), n.encode())


def test_only_an_absent_empty_or_committed_output_of_ours_is_replaced(store_root):
    """A folder (prefix) that holds anything no marker of ours lists is refused in one line naming
    it and its first foreign file, and nothing in it changes; absent, empty and committed outputs
    are replaced whole (files put into a committed output since included); an ingestion's output of
    before ``_COMPLETE`` (its ``_report.json``) counts as ours."""
    root = fs.location(store_root)
    user = root.child("data")
    _put(user, ["nano_dy.root", "other.root", "sub/notes.txt"])
    with pytest.raises(BadInputError, match=r"data: not an output of this pipeline \(it holds nano_dy.root") as e:
        OutputJob(user).begin()
    assert len(str(e.value).splitlines()) == 1
    assert _names(str(user)) == ["nano_dy.root", "other.root", "sub/notes.txt"]
    assert _names(store_root) == ["data/nano_dy.root", "data/other.root", "data/sub/notes.txt"]  # no prefix left
    if root.is_local:
        os.makedirs(root.child("empty").path)
        open(root.child("file").path, "w").close()
        with pytest.raises(BadInputError, match="is a file"):
            OutputJob(root.child("file")).begin()
    for name in (["empty"] if root.is_local else []) + ["absent"]:
        with output_job(root.child(name)) as job:
            job.write_bytes("x.txt", b"x")
        assert _names(str(root.child(name))) == ["_COMPLETE", "x.txt"]
    ours = root.child("ours")
    with output_job(ours) as job:
        job.write_bytes("x.txt", b"1")
    with output_job(ours) as job:
        job.write_bytes("y.txt", b"2")
    assert _names(str(ours)) == ["_COMPLETE", "y.txt"]
    fs.write_bytes(ours.child("sub/put-in-later.txt"), b"x")        # our output, whatever was put into it
    with output_job(ours) as job:
        job.write_bytes("z.txt", b"3")
    assert _names(str(ours)) == ["_COMPLETE", "z.txt"]
    legacy = root.child("legacy")
    _put(legacy, ["_report.json", "_schema.json", "part-00000.parquet"])
    with output_job(legacy) as job:
        job.write_bytes("x.txt", b"x")
    assert _names(str(legacy)) == ["_COMPLETE", "x.txt"]


def test_readers_take_the_marker_list_locally_too(tmp_path):
    """A file put into a committed local output after its commit is read by no reader (the shard
    reader, the dataset listing), and a local folder without a marker is read by listing it."""
    from pipeline.data.parquet import parquet_files

    out = tmp_path / "out"
    with output_job(out) as job:
        a = job.target.attempt(stage=0, partition=0, attempt=0, task_attempt_id=0)
        a.write_table("w0/part-00000.parquet", _table(0, 10))
        job.add([a.record()])
    pq.write_table(_table(100, 110), out / "w0" / "part-00001.parquet")     # a stray, complete and valid
    assert parquet_files(str(out / "w0")) == [str(out / "w0" / "part-00000.parquet")]
    assert _read_ids(str(out)) == list(range(10))
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(_table(0, 3), plain / "a.parquet")
    assert parquet_files(str(plain)) == [str(plain / "a.parquet")]


# --------------------------------------------------------------------------------------------
# fault drills: a real Spark session that retries tasks
# --------------------------------------------------------------------------------------------

def _write_numbers(batches, *, target: JobTarget, unique: bool):
    """Task: the partition's ids as one Parquet file in row groups of 25 rows (a half-written file
    cuts a row group), named ``part-<partition>.parquet`` or, with ``unique``, with a random part
    per attempt as Spark's own writers name them (a retry does not overwrite the failed attempt's
    file: only the commit keeps it out)."""
    import uuid

    attempt = target.attempt()
    table = pa.Table.from_batches(list(batches))
    name = f"part-{attempt.partition:05d}" + (f"-{uuid.uuid4().hex[:8]}" if unique else "")
    nbytes = attempt.write_table(f"{name}.parquet", table, row_group_size=25)
    yield pa.RecordBatch.from_pylist([{"rows": table.num_rows, "bytes": nbytes, **attempt.record()}],
                                     schema=attempt_schema(("rows", pa.int64()), ("bytes", pa.int64())))


def numbers_job(spark, output: str, unique: bool = False) -> dict:
    """A job of PARTS tasks writing ids 0..ROWS-1 through the protocol; the attempts it committed."""
    from pipeline.spark import spark_task

    df = spark.range(0, ROWS, 1, PARTS)
    with output_job(output) as job:
        rows = df.mapInArrow(spark_task(functools.partial(_write_numbers, target=job.target, unique=unique)),
                             f"rows long, bytes long, {ATTEMPT_DDL}").collect()
        job.add(rows)
        job.write_json("_job.json", {"rows": sum(r.rows for r in rows)})
    return {"attempts": sorted(r.attempt_dir for r in rows), "rows": sum(r.rows for r in rows)}


#: (fault, unique names) of the local drills
FAULTS = [("mid:exit", True), ("after:raise", True), ("after:exit", False), ("mid:raise", False)]


def _check_numbers(out: str, drill: dict) -> None:
    assert "result" in drill, drill
    assert drill["result"]["rows"] == ROWS
    # every task's first attempt failed: the committed attempt is the retry (attempt number 1)
    assert [a.split("-")[2] for a in drill["result"]["attempts"]] == ["a1"] * PARTS, drill
    names = [n[:len("part-00000")] if n.startswith("part-") else n for n in _names(out)]
    expected = sorted([f"part-{p:05d}" for p in range(PARTS)] + ["_job.json"])
    assert names == sorted(expected + [COMPLETE_MARKER])
    assert sorted(_read_ids(out)) == list(range(ROWS))                    # exact rows, none twice, none partial


@pytest.mark.slow
def test_killed_and_failed_attempts_leave_exact_outputs_local_and_s3(s3, tmp_path):
    """Each drill kills (``os._exit`` of the Python worker) or fails the first attempt of every task
    mid-write (half of the Parquet file written and closed) or after a complete file; Spark retries
    it. The committed output, on a local path and on S3, holds the ids exactly once, in complete
    files, and no job prefix is left. A clean run is the control."""
    bucket = f"s3://{s3.bucket}/drills"
    calls = [{"call": "test_commit:numbers_job", "kwargs": {"output": str(tmp_path / f"local-{i}"), "unique": u},
              "fault": f} for i, (f, u) in enumerate(FAULTS)]
    calls += [{"call": "test_commit:numbers_job", "kwargs": {"output": f"{bucket}/s3-{i}", "unique": True},
               "fault": f} for i, f in enumerate(["mid:exit", "after:raise"])]
    calls.append({"call": "test_commit:numbers_job", "kwargs": {"output": str(tmp_path / "clean")}, "fault": None})
    drills = run_drills(calls, env=s3.env("writer"))
    for call, drill in zip(calls[:-1], drills[:-1]):
        with environment(**s3.env("writer")):
            _check_numbers(call["kwargs"]["output"], drill)
    assert [a.split("-")[2] for a in drills[-1]["result"]["attempts"]] == ["a0"] * PARTS
    assert sorted(_read_ids(str(tmp_path / "clean"))) == list(range(ROWS))
    assert sorted(os.listdir(tmp_path)) == sorted([f"local-{i}" for i in range(len(FAULTS))] + ["clean"])
    with environment(**s3.env("writer")):
        assert sorted({n.split("/")[0] for n in _names(bucket)}) == ["s3-0", "s3-1"]


# --------------------------------------------------------------------------------------------
# commits stopped at every step (tests/commit_drills.py)
# --------------------------------------------------------------------------------------------

def _parquet_bytes(lo: int, hi: int) -> bytes:
    buf = pa.BufferOutputStream()
    pq.write_table(_table(lo, hi), buf)
    return buf.getvalue().to_pybytes()


def _drill_generation(tag: int) -> dict:
    """A feature-stage-like output: two datasets, a file only this generation has, two JSON files."""
    base = 1000 * tag
    return {"hlf/part-00000.parquet": _parquet_bytes(base, base + 10),
            "hlf/part-00001.parquet": _parquet_bytes(base + 10, base + 20),
            "llf/part-00000.parquet": _parquet_bytes(base + 20, base + 25),
            f"only-{tag}.parquet": _parquet_bytes(base + 25, base + 30),
            "_report.json": json.dumps({"tag": tag}).encode(),
            "scaling.json": json.dumps({"tag": tag}).encode()}


def _drill_check(out: str) -> str:
    """The generation the readers find: the dataset lister, the shard reader and the JSON reader
    must all see one and the same generation, whole."""
    from pipeline.data.parquet import parquet_files
    from pipeline.outputs import read_json

    ids = sorted(_read_ids(out))
    tag = ids[0] // 1000
    assert ids == list(range(1000 * tag, 1000 * tag + 30)), ids
    hlf = []
    for f in parquet_files(f"{out}/hlf"):
        loc = fs.location(f)
        with loc.filesystem().open_input_file(loc.path) as fh:
            hlf.extend(pq.read_table(fh).column("id").to_pylist())
    assert hlf == list(range(1000 * tag, 1000 * tag + 20)), hlf
    assert read_json(f"{out}/_report.json") == {"tag": tag} == read_json(f"{out}/scaling.json")
    return str(tag)


# s3 is slow (about 40 s): each of its about 20 stops is a process of its own (a stop is the
# driver's os._exit), and each process starts an S3 client and probes the bucket
@pytest.mark.parametrize("case", ["local", "local-two-renames", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_commit_stopped_at_any_step_leaves_the_old_or_the_new_output(case, s3, tmp_path):
    """The driver is stopped (``os._exit``) right after each step of a commit in turn (every
    rename, move, copy, marker write and delete): the readers then find the old or the new output,
    whole, never neither and never a mix, and a rerun succeeds. Locally with the atomic exchange
    and with the two renames of filesystems without it; on the S3 server."""
    from commit_drills import drill_every_step

    env = s3.env("writer") if case == "s3" else {}
    out = f"s3://{s3.bucket}/drill-{tmp_path.name}/features" if case == "s3" else str(tmp_path / "features")
    with environment(**env):
        seen = drill_every_step(out, (_drill_generation(0), _drill_generation(1)), _drill_check, env,
                                no_exchange=case == "local-two-renames")
        assert len(seen) >= 8 and {"0", "1"} <= set(seen), seen      # stops before and after the commit point
        names = _names(out)
        assert not any(n.startswith((ATTEMPTS, ".")) for n in names), names
        parent = fs.location(out).sibling("x")
        left = [p.name for p, _ in fs.list_entries(fs.Location(parent.scheme, os.path.dirname(parent.path)))]
        assert left == ["features"], left                             # no staging or set-aside output left


def test_an_output_named_by_a_link_replaces_the_directory_and_keeps_the_link(tmp_path):
    real = tmp_path / "real"
    with output_job(real) as job:
        job.write_bytes("a.txt", b"1")
    (tmp_path / "link").symlink_to(real)
    with output_job(tmp_path / "link") as job:
        job.write_bytes("b.txt", b"2")
    assert (tmp_path / "link").is_symlink() and _names(str(real)) == ["_COMPLETE", "b.txt"]
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]
