"""Delta tables (issue 37): ROOT ingestion with ``output_format: delta`` on the suite's Spark session,
real ROOT files (the coffea NanoAOD samples and small trees written here with edge values), read
back with deltalake, polars and Spark and compared with uproot; only-new-files runs, changed files,
schema changes, partitions, time travel and the snapshot readers; concurrent writers; commits
stopped at every step (tests/delta_drills.py) and a real kill of the job.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delta_drills import REPO, commit_sources, run_drill
from store_fixtures import s3, store_root  # noqa: F401 - the S3 server fixtures (store_root: local and S3)
from servers import environment

from pipeline.errors import BadInputError
from pipeline.fs import list_dirs, location
from pipeline.ingest.root import IngestRootConfig, ingest_root
from pipeline.inputs import dataset_files, parquet_frame, read_parquet
from pipeline.tables import deltalog
from pipeline.tables.job import JOBS_DIR
from pipeline.tables.ledger import read_ledger
from pipeline.tables.snapshot import snapshot_files

NANO = ["run", "luminosityBlock", "event", "nMuon", "Muon_pt", "Muon_charge"]


def _cfg(inputs, out, **kw) -> IngestRootConfig:
    base = dict(input=inputs, tree="Events", filter_name=NANO, output=str(out), output_format="delta",
                mode="new_files")
    return IngestRootConfig(**{**base, **kw})


def _polars(table, version=None, **opts):
    import polars as pl

    return pl.read_delta(str(table), version=version, storage_options=opts or None)


def _deltalake(table):
    """The rows as delta-rs's own query engine reads them (DataFusion), sorted by source and event."""
    import polars as pl
    from deltalake import DeltaTable, QueryBuilder

    r = QueryBuilder().register("t", DeltaTable(str(table))).execute("select * from t")
    return pl.DataFrame(r.read_all())


def _uproot(path, branches=NANO) -> dict:
    import uproot

    arrays = uproot.open(path)["Events"].arrays(branches, library="ak")
    return {b: arrays[b].to_list() for b in branches}


def _rows_of(df, sample) -> dict:
    import polars as pl

    sub = df.filter(pl.col("sample") == sample).sort("event")
    return {c: sub[c].to_list() for c in NANO}


def _sorted_by_event(d: dict) -> dict:
    order = np.argsort(np.asarray(d["event"]), kind="stable")
    return {k: [v[i] for i in order] for k, v in d.items()}


def test_new_files_partitions_changes_time_travel_and_snapshot_readers(spark, tmp_path, samples_dir, capsys):
    """Day 1: two NanoAOD files land in folders a/ and b/ (the partition column ``sample``); the
    table's values, read with deltalake and polars, equal uproot's (unsigned branches widened to
    int64, the values intact). A rerun is a no-op in one line; a new file is the only one read; a
    changed file is refused, skipped or replaced by option; readers take the snapshot's files,
    never the folder (a replaced file and a stray file stay on disk unread); versions travel."""
    land, table = tmp_path / "land", tmp_path / "table"
    (land / "a").mkdir(parents=True)
    (land / "b").mkdir()
    shutil.copy(samples_dir / "nano_dy.root", land / "a" / "x1.root")
    shutil.copy(samples_dir / "nano_dimuon.root", land / "b" / "x2.root")
    glob = str(land / "*" / "*.root")
    cfg = _cfg(glob, table, partition_by="sample")

    r = ingest_root(cfg, spark)
    assert (r["version"], r["rows"], r["new_files"]) == (0, 80, 2)
    assert sorted(p.name for p in table.iterdir()) == ["_delta_log", "_pipeline", "sample=a", "sample=b"]
    for df in (_polars(table), _deltalake(table)):
        assert df.height == 80
        assert str(df.schema["event"]) == "Int64" and str(df.schema["nMuon"]) == "Int64"   # uint64/uint32 widened
        assert _rows_of(df, "a") == _sorted_by_event(_uproot(land / "a" / "x1.root"))
        assert _rows_of(df, "b") == _sorted_by_event(_uproot(land / "b" / "x2.root"))

    # nothing new: one line, no new version
    capsys.readouterr()
    r = ingest_root(cfg, spark)
    assert r["nothing_new"] and r["version"] == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{table}: nothing new: the table (version 0) holds all 2 input file(s) unchanged; nothing was "
                   "written"]

    # a new file: only it is read
    shutil.copy(samples_dir / "nano_dy.root", land / "a" / "x3.root")
    r = ingest_root(cfg, spark)
    assert [f["file"] for f in r["files"]] == [str(land / "a" / "x3.root")] and r["held_files"] == 2
    assert (r["version"], _polars(table).height) == (1, 120)

    # x1 changes (another file's bytes under its name): fail (default), skip, or replace its rows
    shutil.copy(samples_dir / "nano_dimuon.root", land / "a" / "x1.root")
    with pytest.raises(BadInputError, match=r"x1\.root: changed since the table ingested it at version 0.*"
                                             r"on_changed: fail"):
        ingest_root(cfg, spark)
    r = ingest_root(cfg.model_copy(update={"on_changed": "skip"}), spark)
    assert r["nothing_new"] and r["version"] == 1
    assert "x1.root: changed since" in capsys.readouterr().out
    old_x1 = [f for f in deltalog.snapshot(deltalog_loc(table)).files if f.partition_values["sample"] == "a"]
    r = ingest_root(cfg.model_copy(update={"on_changed": "replace"}), spark)
    assert r["version"] == 2 and [f["file"] for f in r["files"]] == [str(land / "a" / "x1.root")]
    df = _polars(table)
    assert df.height == 120
    assert _rows_of(df, "a") == _sorted_by_event({k: a + b for (k, a), b in zip(
        _uproot(land / "a" / "x1.root").items(), _uproot(land / "a" / "x3.root").values())})
    assert sorted(read_ledger(deltalog_loc(table)).sources) == sorted(str(p) for p in land.glob("*/*.root"))

    # readers: the snapshot's files only (the replaced part is still on disk, a stray file is never read)
    pq.write_table(pa.table({"event": [1]}), table / "sample=a" / "stray.parquet")
    files = dataset_files(str(table))
    assert len(files) == 3 and not any("stray" in f for f in files)
    replaced = [str(table / f.path) for f in old_x1 if "x1" not in f.path]
    assert all(os.path.exists(p) for p in replaced)
    assert not set(replaced) & {f for f in files if f not in {str(table / x.path) for x in old_x1}}
    assert spark.read.parquet(*files).count() == 120
    assert sorted(spark.read.option("basePath", str(table)).parquet(*files).select("sample").distinct()
                  .toPandas()["sample"]) == ["a", "b"]
    # time travel: version 0 held the first two files, version 1 the unchanged x1
    assert parquet_frame(spark, str(table), columns=["event"], version=0).count() == 80
    assert _polars(table, version=1).height == 120
    assert sorted(_polars(table, version=0)["event"].to_list()) == sorted(
        _uproot(samples_dir / "nano_dy.root")["event"] + _uproot(samples_dir / "nano_dimuon.root")["event"])
    with pytest.raises(BadInputError, match="no version 9"):
        dataset_files(str(table), version=9)

    # the Parquet output of the same files keeps the unsigned types
    pout = tmp_path / "parquet"
    ingest_root(IngestRootConfig(input=str(land / "b" / "*.root"), tree="Events", filter_name=NANO,
                                 output=str(pout)), spark)
    schema = pq.read_schema(next(pout.glob("part-*.parquet")))
    assert (str(schema.field("event").type), str(schema.field("nMuon").type)) == ("uint64", "uint32")


def deltalog_loc(path):
    from pipeline.fs import location

    return location(str(path))


def _tree(path: Path, **cols) -> Path:
    import uproot

    with uproot.recreate(str(path)) as f:
        f["Events"] = {k: np.asarray(v) for k, v in cols.items()}
    return path


def test_unsigned_edges_and_schema_changes(spark, tmp_path):
    """uint8/16/32 widen (255, 65535, 2^32-1 read back exactly, never negative); uint64 up to
    2^63-1 is kept, 2^63 is refused naming the branch and the value; a new branch joins as a
    nullable column or is refused naming branch and file; a changed type is refused; a refused
    run leaves the table as it was."""
    land, table = tmp_path / "land", tmp_path / "table"
    land.mkdir()
    edges = dict(u8=np.array([0, 255], np.uint8), u16=np.array([0, 65535], np.uint16),
                 u32=np.array([2 ** 31, 2 ** 32 - 1], np.uint32), u64=np.array([0, 2 ** 63 - 1], np.uint64),
                 f=np.array([1.5, 2.5], np.float32))
    _tree(land / "t1.root", **edges)
    cfg = _cfg(str(land / "*.root"), table, filter_name=["*"])
    assert ingest_root(cfg, spark)["version"] == 0
    df = _polars(table)
    assert {c: str(df.schema[c]) for c in ("u8", "u16", "u32", "u64")} == dict(u8="Int16", u16="Int32",
                                                                                 u32="Int64", u64="Int64")
    assert {c: df[c].to_list() for c in edges} == {c: v.tolist() for c, v in edges.items()}

    # a new branch: refused by option (one line naming it and the file), else a nullable column
    _tree(land / "t2.root", **edges, extra=np.array([7.0, 8.0]))
    with pytest.raises(BadInputError, match=r"t2\.root: branch 'extra' is not a column of the table"):
        ingest_root(cfg.model_copy(update={"schema_changes": "refuse"}), spark)
    assert deltalog.snapshot(deltalog_loc(table)).version == 0
    r = ingest_root(cfg, spark)
    df = _polars(table).sort("extra", nulls_last=True)
    assert r["version"] == 2 and df["extra"].to_list() == [7.0, 8.0, None, None]   # 1: the column, 2: the rows

    # a changed type (float32 -> float64) is refused before any work
    _tree(land / "t3.root", **{**edges, "f": np.array([1.0, 2.0])})
    with pytest.raises(BadInputError, match=r"t3\.root: branch 'f' is double here and float in the table"):
        ingest_root(cfg, spark)
    (land / "t3.root").unlink()
    # uint64 beyond int64: refused naming the branch and the value; no rows committed (the version the
    # run adds records the failure only: pipeline.tables.quarantine)
    _tree(land / "t4.root", **{**edges, "u64": np.array([1, 2 ** 63], np.uint64)})
    with pytest.raises(BadInputError, match=r"t4\.root: branch 'u64': value 9223372036854775808 does not fit"):
        ingest_root(cfg, spark)
    assert deltalog.snapshot(deltalog_loc(table)).files == deltalog.snapshot(deltalog_loc(table), 2).files
    assert sorted(read_ledger(deltalog_loc(table)).sources) == [str(land / "t1.root"), str(land / "t2.root")]


def test_concurrent_writers_one_wins_the_other_retries_or_fails(tmp_path, s3):
    """Jobs prepared on the same version: with other inputs the later commit is retried on the new
    version (nothing lost); with the same input it fails in one line and leaves no file in the
    table. Eight writers committing at once (threads) all land, each file once. The same-input
    conflict also on the S3 server (delta-rs's conditional PUT of the log entry)."""
    from pipeline.tables.job import DeltaJob

    table = tmp_path / "t"
    a = commit_sources(str(table), ["a.root"], begin_only=True)
    b = commit_sources(str(table), ["b.root"], begin_only=True)
    a.commit()
    b.commit()                                        # created by a: b retries as an append
    snap = deltalog.snapshot(deltalog_loc(table))
    assert snap.version == 1 and len(snap.files) == 2
    c = commit_sources(str(table), ["c.root", "d.root"], begin_only=True)
    d = commit_sources(str(table), ["e.root", "d.root"], begin_only=True)
    c.commit()
    with pytest.raises(BadInputError, match=r"another job committed d\.root \(version 2\) while this one ran; "
                                            "nothing of this run was committed"):
        d.commit()
    d.abort()
    snap = deltalog.snapshot(deltalog_loc(table))
    on_disk = sorted(str(p.relative_to(table)) for p in table.glob("*.parquet"))
    assert snap.version == 2 and on_disk == sorted(f.path for f in snap.files)
    assert not any((table / "_pipeline" / "jobs").iterdir())

    jobs = [commit_sources(str(table), [f"r{i}.root"], begin_only=True) for i in range(8)]
    start = threading.Barrier(len(jobs))
    errors = []

    def go(job: DeltaJob):
        start.wait()
        try:
            job.commit()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    snap = deltalog.snapshot(deltalog_loc(table))
    assert snap.version == 10 and len(snap.files) == 12 and len({f.path for f in snap.files}) == 12
    assert sorted(read_ledger(deltalog_loc(table)).sources) == sorted(
        ["a.root", "b.root", "c.root", "d.root"] + [f"r{i}.root" for i in range(8)])

    with environment(**s3.env("writer")):
        uri = f"s3://{s3.bucket}/concurrent"
        x = commit_sources(uri, ["s.root"], begin_only=True)
        y = commit_sources(uri, ["s.root"], begin_only=True)
        x.commit()
        with pytest.raises(BadInputError, match=r"another job committed s\.root \(version 0\)"):
            y.commit()
        y.abort()
        snap = deltalog.snapshot(deltalog_loc(uri))
        assert snap.version == 0 and len(snap.files) == 1
        from pipeline.fs import list_files, location
        assert sorted(f.path for f in list_files(location(uri), ".parquet")) == [
            f"{s3.bucket}/concurrent/{snap.files[0].path}"]


def test_a_commit_stopped_at_any_step_is_exactly_once(tmp_path):
    """A process commits three inputs' files to a table holding one, and is stopped (``os._exit``)
    after each step in turn: every move, the log entry, the clean-up. After each stop the table is
    the old version or the new one (never a mix), and a rerun that commits what the ledger does not
    hold leaves every input's rows in the table exactly once."""
    for kill in range(1, 7):
        table = tmp_path / f"t{kill}"
        commit_sources(str(table), ["old.root"])
        rc = run_drill(str(table), ["n1.root", "n2.root", "n3.root"], kill)
        snap = deltalog.snapshot(deltalog_loc(table))
        held = sorted(read_ledger(deltalog_loc(table)).sources)
        if snap.version == 0:
            assert rc == 57 and held == ["old.root"] and len(snap.files) == 1, kill
        else:
            assert snap.version == 1 and held == ["n1.root", "n2.root", "n3.root", "old.root"], kill
            assert len(snap.files) == 4
        todo = [s for s in ("n1.root", "n2.root", "n3.root") if s not in held]
        if todo:
            commit_sources(str(table), todo)
        snap = deltalog.snapshot(deltalog_loc(table))
        led = read_ledger(deltalog_loc(table))
        live = {f.path for f in snap.files}
        per_source = {s: [p["path"] for p in e["parts"] if p["path"] in live] for s, e in led.sources.items()}
        assert sorted(per_source) == ["n1.root", "n2.root", "n3.root", "old.root"], kill
        assert all(len(v) == 1 for v in per_source.values()) and len(live) == 4, (kill, per_source)
        rows = pq.ParquetDataset([str(table / p) for p in live]).read().column("source").to_pylist()
        assert sorted(rows) == ["n1.root", "n2.root", "n3.root", "old.root"], kill


def _held_once(table: str, sources: list[str]) -> None:
    """The newest snapshot of ``table`` holds one file per source, each on the store and holding
    its source's row, and the ledger names exactly those files; no job prefix is left."""
    loc = location(table)
    snap = deltalog.snapshot(loc)
    led = read_ledger(loc)
    assert sorted(led.sources) == sorted(sources)
    assert {f.path for f in snap.files} == set(led.parts()), (snap.files, sorted(led.parts()))
    rows = [r for f in snap.files for r in read_parquet(str(loc.child(f.path))).column("source").to_pylist()]
    assert sorted(rows) == sorted(sources)
    assert list_dirs(loc.child(JOBS_DIR)) == []


@pytest.mark.parametrize("fault", deltalog.LOG_FAULTS)
def test_a_log_write_that_lands_and_then_fails_is_the_jobs_own_commit(store_root, fault):
    """The commit drill of an unknown outcome, in a process of its own, on local disk and on the S3
    server: the log entry is written, and then the writer sees a 412 on its retry (``retry``, the
    store's conditional PUT answering the write that already landed), an error (``raise``), or is
    stopped (``exit``). The job finds its own entry by its id: it is committed once, nothing it
    moved is deleted, and a rerun finds nothing new."""
    table = f"{store_root}/t-{fault}"
    commit_sources(table, ["old.root"])
    assert run_drill(table, ["n1.root", "n2.root"], 0, fault) in ((1,) if fault == "exit" else (0,))
    assert deltalog.snapshot(location(table)).version == 1
    _held_once(table, ["n1.root", "n2.root", "old.root"])


@pytest.mark.parametrize("b_through", ["same folder", "symlink"])
def test_a_run_that_chose_its_inputs_before_another_committed_them_is_refused(spark, tmp_path, samples_dir,
                                                                                monkeypatch, b_through):
    """A second only-new run (B) commits the same new files while the first (A) is between choosing
    its inputs from the ledger and its commit (a hook runs B right after A's input selection):
    A fails in one line before moving anything, and every file's rows are in the table once;
    when the table did not exist at A's choice, and when it did; also when B names the files
    through a symlink to the landing folder (one input by its real path)."""
    import pipeline.ingest.root.stage as stage

    land, table = tmp_path / "land", tmp_path / "table"
    land.mkdir()
    select = stage.select_inputs
    b_land = land
    if b_through == "symlink":
        b_land = tmp_path / "link"
        b_land.symlink_to(land)

    def racing(cfg, files, out):
        run = select(cfg, files, out)
        monkeypatch.setattr(stage, "select_inputs", select)
        ingest_root(cfg.model_copy(update={"input": str(b_land / "*.root")}), spark)   # B: the same inputs, first
        return run

    cfg = _cfg(str(land / "*.root"), table, filter_name=["event"])
    events = []
    for i, name in enumerate(("nano_dy.root", "nano_dimuon.root")):
        shutil.copy(samples_dir / name, land / f"x{i}.root")
        events += _uproot(land / f"x{i}.root", ["event"])["event"]
        monkeypatch.setattr(stage, "select_inputs", racing)
        with pytest.raises(BadInputError, match=rf"another job committed {b_land / f'x{i}.root'} \(version {i}\) "
                                                "while this one ran; nothing of this run was committed"):
            ingest_root(cfg, spark)
        df = _polars(table)
        assert sorted(df["event"].to_list()) == sorted(events), i          # each file once
        assert deltalog.snapshot(deltalog_loc(table)).version == i
        assert sorted(str(p.relative_to(table)) for p in table.glob("*.parquet")) == sorted(
            f.path for f in deltalog.snapshot(deltalog_loc(table)).files)   # nothing of A moved in


def test_time_travel_over_a_replace_reads_each_versions_ledger(tmp_path):
    """The ledger at version V holds the commits up to V only, also after a later replace: every
    data file of each version's snapshot has its source record there (the feature stage's
    ``input_version`` check), and the newest ledger is the replaced input's new record."""
    table = str(tmp_path / "t")
    loc = location(table)
    commit_sources(table, ["a.root"])
    commit_sources(table, ["b.root"])
    job = commit_sources(table, ["a.root"], begin_only=True)
    job.removes = [p for p, (s, _) in read_ledger(loc).parts().items() if s["file"] == "a.root"]
    job.record["replaced"] = ["a.root"]
    job.commit()
    want = {0: {"a.root": 0}, 1: {"a.root": 0, "b.root": 1}, 2: {"a.root": 2, "b.root": 1}}
    for v, sources in want.items():
        led = read_ledger(loc, v)
        assert led.version == v and {f: s["version"] for f, s in led.sources.items()} == sources, v
        assert {f.path for f in deltalog.snapshot(loc, v).files} == set(led.parts()), v
    assert [v for v, _ in deltalog.commits(loc, 1)] == [0, 1]
    with pytest.raises(BadInputError, match="no version 3 of this Delta table"):
        read_ledger(loc, 3)


def test_partition_values_that_need_quoting_name_the_files_on_disk(tmp_path):
    """A partition value with a space, ``=``, ``%`` and a non-ASCII letter: its folder is quoted on
    disk and quoted again in the Delta log; the snapshot's files are the files on disk, the
    ledger's parts, and what a replace removes (on the job's own version and after a conflict)."""
    value = "q=c%20d é 2024"
    table = str(tmp_path / "t")
    loc = location(table)
    commit_sources(table, ["a.root", "b.root"], sample=value)
    snap = deltalog.snapshot(loc)
    assert [f.partition_values for f in snap.files] == [{"sample": value}] * 2
    assert all(os.path.isfile(f) for f in snapshot_files(table)) and len(snapshot_files(table)) == 2
    assert {f.path for f in snap.files} == set(read_ledger(loc).parts())
    assert sorted(_polars(table)["sample"].to_list()) == [value] * 2
    for src, other in (("a.root", None), ("b.root", "c.root")):      # a replace; then one after a conflict
        job = commit_sources(table, [src], sample=value, begin_only=True)
        job.inputs_chosen_at(job.base.version)
        job.removes = [p for p, (s, _) in read_ledger(loc).parts().items() if s["file"] == src]
        job.record["replaced"] = [src]
        if other:
            commit_sources(table, [other], sample=value)
        job.commit()
    _held_once(table, ["a.root", "b.root", "c.root"])
    assert deltalog.snapshot(loc).version == 3


@pytest.mark.slow   # a spark-submit-like process of its own (Spark's start-up: ~15 s on 2 idle cores)
def test_ingestion_killed_mid_commit_and_rerun_holds_every_file_once(spark, tmp_path, samples_dir):
    """The real job, killed right after moving its first file into the table (before the log
    entry), then rerun: every file's rows are in the table once; the killed job's moved file is
    in the folder and in no snapshot."""
    land, table = tmp_path / "land", tmp_path / "table"
    land.mkdir()
    for i in range(3):
        shutil.copy(samples_dir / "nano_dy.root", land / f"x{i}.root")
    env = {**os.environ, "PIPELINE_TEST_COMMIT_KILL": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "jobs.ingest_root", "--input", str(land / "*.root"), "--tree", "Events",
                        "--set", "filter_name=[event, nMuon]", "--output", str(table), "--set", "output_format=delta",
                        "--set", "mode=new_files", "--spark.master", "local[1]"],
                       cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 57, r.stderr[-2000:]
    assert "stopped after step 1: moved" in r.stderr
    assert not deltalog.is_table(deltalog_loc(table)) and len(list(table.glob("*.parquet"))) == 1
    rep = ingest_root(_cfg(str(land / "*.root"), table, filter_name=["event", "nMuon"]), spark)
    assert (rep["version"], rep["new_files"]) == (0, 3)
    df = _polars(table)
    assert df.height == 120 and sorted(df["event"].to_list()) == sorted(
        _uproot(samples_dir / "nano_dy.root", ["event"])["event"] * 3)
    assert len(list(table.glob("*.parquet"))) == 4 and len(dataset_files(str(table))) == 3


def test_s3_table_new_files_read_by_deltalake_and_the_feature_inputs(spark, tmp_path, samples_dir, s3):
    """On the S3 server: a table ingested with new_files twice (the second run reads only the new
    file), read back with polars (delta-rs's S3 client) equal to uproot, and the snapshot's files
    through the pipeline's reader."""
    land = tmp_path / "land"
    land.mkdir()
    shutil.copy(samples_dir / "nano_dy.root", land / "x1.root")
    with environment(**s3.env("writer")):
        uri = f"s3://{s3.bucket}/{tmp_path.name}/table"
        cfg = _cfg(str(land / "*.root"), uri)
        assert ingest_root(cfg, spark)["version"] == 0
        shutil.copy(samples_dir / "nano_dimuon.root", land / "x2.root")
        r = ingest_root(cfg, spark)
        assert r["version"] == 1 and [f["file"] for f in r["files"]] == [str(land / "x2.root")]
        assert ingest_root(cfg, spark)["nothing_new"]
        opts = deltalog.storage_options(deltalog_loc(uri))
        df = _polars(uri, **opts).sort("event")
        want = _sorted_by_event({k: a + b for (k, a), b in zip(_uproot(land / "x1.root").items(),
                                                                 _uproot(land / "x2.root").values())})
        assert {c: df[c].to_list() for c in NANO} == want
        files = dataset_files(uri)
        assert len(files) == 2 and all(f.startswith(f"{uri}/part-") for f in files)
        assert parquet_frame(spark, uri, columns=["event"]).count() == 80


def test_images_into_a_table_partitioned_by_split(spark, tmp_path):
    """ingest_images with output_format delta: a version per run (overwrite, then append), one file
    per split value in its folder, read back with polars and the pipeline's snapshot reader; a
    Parquet output of ours is refused as a table target in one line."""
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images

    table = tmp_path / "digits"
    cfg = ImagesIngestConfig(source="sklearn_digits", output=str(table), output_format="delta", partition_by="split",
                             records_per_part=1000)
    r = ingest_images(cfg, spark)
    assert r["version"] == 0 and r["rows"] == 1797
    r = ingest_images(cfg.model_copy(update={"mode": "append", "limit": 100}), spark)
    assert r["version"] == 1
    df = _polars(table)
    counts = {s: n for s, n in zip(*df.group_by("split").len().sort("split").to_dict(as_series=False).values())}
    assert sum(counts.values()) == 1897 and set(counts) == {"train", "val", "test"}
    assert sorted(p.name for p in table.glob("split=*")) == ["split=test", "split=train", "split=val"]
    test_files = [f for f in dataset_files(str(table)) if "/split=test/" in f]
    assert sorted(df.filter(df["split"] == "test")["sample_id"].to_list()) == sorted(
        x for f in test_files for x in pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist())
    assert len(dataset_files(str(table), version=0)) < len(dataset_files(str(table)))
    pout = tmp_path / "parquet"
    ingest_images(ImagesIngestConfig(source="sklearn_digits", output=str(pout), limit=50), spark)
    with pytest.raises(BadInputError, match="a Parquet output of this pipeline, not a Delta table"):
        ingest_images(cfg.model_copy(update={"output": str(pout)}), spark)


@pytest.mark.slow   # two days of ingestion, features and shards through Spark (~40 s on 2 idle cores)
def test_features_and_shards_from_table_snapshots_and_versions(spark, tmp_path, delphes_root):
    """Day 1 and day 2 of the daily recipe in process: the feature stage reads the table's snapshot
    (each data file's ROOT file and entries from the ledger) into Delta tables hlf/ and llf/, one
    version per day, each carrying its scaling.json; the shard stage reads hlf/ at the newest
    version and, with input_version, at day 1's. The landing folders' names need quoting; day 2
    also replaces a changed file, and the feature stage's plan at version 0 still finds day 1's files."""
    from pipeline.features.plan import plan_units
    from pipeline.features.stage import FeaturesConfig, build_features
    from pipeline.features.delphes import REQUIRED_BRANCHES
    from pipeline.shards.materialize import ShardConfig, shard

    land, table, feats = tmp_path / "land", tmp_path / "table", tmp_path / "features"
    # partition values that need quoting: a space, "=", "%" and a non-ASCII letter (quoted on disk, again in the log)
    folders = {"qcd": "qcd=a%20b é", "ttbar": "ttbar 2024"}
    for c, folder in folders.items():
        (land / folder).mkdir(parents=True)
        shutil.copy(delphes_root, land / folder / f"{c}_0.root")
    cfg = _cfg(str(land / "*" / "*.root"), table, tree="Delphes", filter_name=list(REQUIRED_BRANCHES),
               partition_by="sample")
    fcfg = FeaturesConfig(input=str(table), output=str(feats), output_format="delta", test_fraction=0,
                          val_fraction=0)
    ingest_root(cfg, spark)
    snap = deltalog.snapshot(deltalog_loc(table))
    assert sorted(f.partition_values["sample"] for f in snap.files) == sorted(folders.values())
    assert all(os.path.isfile(f) for f in dataset_files(str(table)))      # the shard stage's reader
    day1 = build_features(fcfg, spark)
    assert sorted(f["file"] for f in day1["files"]) == sorted(str(p) for p in land.glob("*/*.root"))
    (land / "wjets").mkdir()
    shutil.copy(delphes_root, land / "wjets" / "wjets_0.root")
    qcd = land / folders["qcd"] / "qcd_0.root"
    os.utime(qcd, ns=(qcd.stat().st_atime_ns, qcd.stat().st_mtime_ns + 10 ** 9))      # changed: its rows replaced
    assert ingest_root(cfg.model_copy(update={"on_changed": "replace"}), spark)["new_files"] == 2
    files0 = plan_units(fcfg.model_copy(update={"input_version": 0}))[0]              # time travel over the replace
    assert sorted(f.path for f in files0) == sorted(f["file"] for f in day1["files"])
    day2 = build_features(fcfg, spark)
    assert len(day2["files"]) == 3 and day2["splits"]["train"] == day1["splits"]["train"] + 1
    assert (day1["input_versions"], day2["input_versions"]) == ({str(table): 0}, {str(table): 1})   # in report.json
    hlf = deltalog_loc(feats / "hlf")
    records = deltalog.commits(hlf)
    assert [v for v, _ in records] == [0, 1] and deltalog.snapshot(hlf).version == 1
    assert [r["files"]["report.json"]["splits"]["train"] for _, r in records] == [2, 3]
    assert {"scaling.json", "report.json"} <= {p.name for p in feats.iterdir()}
    now = shard(ShardConfig(input=str(feats / "hlf"), output=str(tmp_path / "s1"), workers=1), spark)
    then = shard(ShardConfig(input=str(feats / "hlf"), output=str(tmp_path / "s0"), workers=1, input_version=0),
                 spark)
    assert (now["n_train_samples"], then["n_train_samples"]) == (3, 2)
