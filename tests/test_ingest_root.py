"""ROOT -> Parquet ingestion on the real coffea sample files (Delphes, NanoAOD, broken, empty)."""
from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hep_root_fixtures as H  # noqa: E402

from pipeline.errors import BadInputError, ConfigError  # noqa: E402
from pipeline.ingest.root import IngestRootConfig, ingest_root, open_tree, parse_step_size, plan_chunks  # noqa: E402


def _read(path) -> pa.Table:
    return pads.dataset(str(path), format="parquet", ignore_prefixes=[".", "_"]).to_table()


def _sorted_by_part(path) -> pa.Table:
    files = sorted(p for p in os.listdir(path) if p.endswith(".parquet"))
    import pyarrow.parquet as pq
    return pa.concat_tables([pq.read_table(os.path.join(path, f)) for f in files])


def test_step_size_parsing():
    assert parse_step_size(1000) == ("entries", 1000)
    assert parse_step_size("100 MB") == ("bytes", 100 * 1024 ** 2)
    assert parse_step_size("2kB") == ("bytes", 2048)
    with pytest.raises(ValueError):
        parse_step_size("ten")
    with pytest.raises(ConfigError, match="step_size"):
        from pipeline.config import build_config
        build_config(IngestRootConfig, {"input": "x.root", "step_size": "lots"})


def test_a_file_is_cut_evenly_at_the_nearest_cluster_starts():
    from pipeline.ingest.root.planning import cut_ranges

    clusters = list(range(0, 50_001, 5_000))
    # 3 chunks of about 16,667 entries, at the nearest cluster starts: no short tail chunk
    assert cut_ranges(0, 50_000, 18_000, clusters) == [(0, 15_000), (15_000, 35_000), (35_000, 50_000)]
    # two task slots for this one file: a multiple of 2 chunks, each at most 3 clusters
    four = cut_ranges(0, 50_000, 18_000, clusters, spread=2)
    assert len(four) == 4 and max(b - a for a, b in four) <= 15_000
    assert four[0][0] == 0 and four[-1][1] == 50_000 and all(x[1] == y[0] for x, y in zip(four, four[1:]))
    assert all(a in clusters for a, _ in four)
    # one chunk stays one chunk whatever the slots; no clusters: plain even cuts
    assert cut_ranges(0, 50_000, 60_000, clusters, spread=4) == [(0, 50_000)]
    assert cut_ranges(10, 40, 10, []) == [(10, 20), (20, 30), (30, 40)]
    # a cluster over twice the target is split evenly; an entry window starts mid-cluster
    assert cut_ranges(0, 100, 10, [90]) == [(i, i + 10) for i in range(0, 100, 10)]
    assert cut_ranges(3, 25, 10, [0, 10, 20]) == [(3, 10), (10, 20), (20, 25)]


def test_cluster_starts_are_uproots_common_entry_offsets(samples_dir, tmp_path):
    import uproot

    from pipeline.ingest.root import branches_by_name, open_tree
    from pipeline.ingest.root.planning import _cluster_starts

    path = tmp_path / "three.root"
    with uproot.recreate(path) as f:
        f.mktree("t", {"a": np.float64, "b": np.int64})
        f["t"].extend({"a": np.arange(10.0), "b": np.arange(10)})
        f["t"].extend({"a": np.arange(10.0), "b": np.arange(10)})
        f["t"].extend({"a": np.arange(5.0), "b": np.arange(5)})
    cases = [(path, "t", ["a", "b"]), (path, "t", ["b"]), (samples_dir / "nano_dy.root", "Events", None),
             (samples_dir / "delphes.root", "Delphes", ["Jet.PT", "Electron.PT", "Event.Number"])]
    for p, tree, names in cases:
        t = open_tree(str(p), tree)
        by_name = branches_by_name(t)
        names = names or [n for n in by_name if "[" not in n and "*" not in n]
        ours = _cluster_starts(t, by_name, names)
        assert ours == [int(x) for x in uproot.open(p)[tree].common_entry_offsets(filter_name=names)], p
    assert _cluster_starts(open_tree(str(path), "t"), branches_by_name(open_tree(str(path), "t")), ["a"]) == [0, 10, 20, 25]


def test_plan_chunks_cuts_entry_ranges(delphes_root):
    plan = plan_chunks([str(delphes_root)], "Delphes", ["Jet.PT", "Electron.*"], step_size=10)
    ranges = [(c.entry_start, c.entry_stop) for c in plan.chunks]
    assert ranges[0][0] == 0 and ranges[-1][1] == 25
    assert all(b - a <= 20 for a, b in ranges) and len(ranges) >= 2
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    # object branches matched by the glob (Electron.Particle is a TRef) are kept, with the type
    # of a real read; the container branch "Electron" itself is not a column
    import uproot
    from pipeline.ingest.root import to_arrow
    real = to_arrow(uproot.open(delphes_root)["Delphes"].arrays(["Electron.Particle"], entry_stop=3))
    assert "Electron.PT" in plan.branches and "Electron" not in plan.branches
    assert plan.schema.field("Electron.Particle").type == real.schema.field(0).type


def test_ingest_delphes_matches_uproot(any_spark, delphes_root, tmp_path):
    spark = any_spark   # a classic and a Spark Connect session: both passes of the ingestion's tasks
    import uproot

    out = tmp_path / "events"
    cfg = IngestRootConfig(input=str(delphes_root), tree="Delphes", output=str(out), step_size=10,
                           filter_name=["Electron.PT", "Jet.PT", "Jet.BTag", "Jet.FracPt[5]", "MissingET.MET",
                                        "Event.Number"],
                           schema_dir=str(tmp_path / "schemas"))
    rep = ingest_root(cfg, spark=spark)
    assert rep["rows"] == 25 and not rep["bad_files"]
    assert len(rep["files"][0]["parts"]) >= 2          # several chunks -> several Spark tasks
    table = _sorted_by_part(out)
    t = uproot.open(delphes_root)["Delphes"]
    for b in ["Electron.PT", "Jet.PT", "MissingET.MET"]:
        assert table.column(b).to_pylist() == t[b].array(library="ak").tolist()
    assert table.column("Event.Number").to_pylist() == t["Event.Number"].array().tolist()
    # jagged -> list, fixed-size arrays stay fixed-size, unsigned stays unsigned
    assert pa.types.is_list(table.schema.field("Jet.PT").type)
    frac = table.schema.field("Jet.FracPt[5]").type
    assert pa.types.is_fixed_size_list(frac.value_type) and frac.value_type.list_size == 5
    assert table.schema.field("Jet.BTag").type.value_type == pa.uint32()
    # Spark reads it back
    assert spark.read.parquet("file://" + str(out)).count() == 25
    # schema stored next to the data; this column set is not among the reviewed versions of
    # schemas/root/delphes, so the next version is minted into the registry folder (never schemas/)
    from pipeline.schemas import SCHEMA_DIR, schema_versions
    sj = json.loads((out / "_schema.json").read_text())
    assert [c["name"] for c in sj["columns"]] == table.schema.names
    reviewed = schema_versions("root/delphes", SCHEMA_DIR)
    assert sj["version"] == max(reviewed) + 1
    minted = json.loads((tmp_path / "schemas" / "root" / "delphes" / f"v{sj['version']}.json").read_text())
    assert [c["name"] for c in minted["columns"]] == table.schema.names
    assert schema_versions("root/delphes", SCHEMA_DIR) == reviewed
    rep2 = json.loads((out / "_report.json").read_text())
    assert rep2["files"][0]["entries"] == 25 and rep2["schema"]["name"] == "root/delphes"


def _spark_jobs(spark, fn):
    """fn()'s result and the number of places in our code that ran Spark jobs (a job group of its
    own; one collect may run more than one job)."""
    sc = spark.sparkContext
    group = f"count-{time.monotonic_ns()}"
    sc.setJobGroup(group, "counted")
    try:
        result = fn()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    st = sc.statusTracker()
    return result, len({st.getStageInfo(s).name for j in st.getJobIdsForGroup(group) for s in st.getJobInfo(j).stageIds})


def test_a_large_first_file_is_planned_once_and_cut_for_every_task_slot(spark, delphes_root, tmp_path):
    """The driver opens the first file for the schema and cuts it there: its chunks go straight to
    the second pass (one Spark job, no first-pass task opening it again), as many as a multiple of
    the session's 2 slots; a second file still takes both passes. The rows are uproot's, in order."""
    import uproot

    branches = ["Jet.PT", "MissingET.MET", "Event.Number"]
    t = uproot.open(delphes_root)["Delphes"]
    second = tmp_path / "copy.root"
    shutil.copy(delphes_root, second)
    from pipeline.spark import get_spark
    get_spark()           # its one-off check of the executors' Python is a Spark job: not counted
    runs = {}
    for name, inputs in {"one": [str(delphes_root)], "two": [str(delphes_root), str(second)]}.items():
        cfg = IngestRootConfig(input=inputs, tree="Delphes", output=str(tmp_path / name), step_size=10,
                               filter_name=branches, schema_dir=str(tmp_path / "schemas"))
        runs[name] = _spark_jobs(spark, lambda: ingest_root(cfg, spark=spark))
    (one, jobs_one), (two, jobs_two) = runs["one"], runs["two"]
    assert jobs_one == 1 and jobs_two == 2
    parts = one["files"][0]["parts"]
    assert len(parts) == 4                            # ceil(25 / 10) = 3 chunks, a multiple of 2 slots
    assert [p["entry_start"] for p in parts] == [0, 6, 12, 18] and parts[-1]["entry_stop"] == 25
    assert [len(f["parts"]) for f in two["files"]] == [3, 3]       # two files fill the slots themselves
    for name in runs:
        table = _sorted_by_part(tmp_path / name)
        copies = len(runs[name][0]["files"])
        for b in branches:
            assert table.column(b).to_pylist() == t[b].array(library="ak").tolist() * copies


def test_a_file_rewritten_between_two_runs_of_one_session_is_read_anew(spark, tmp_path):
    """The Python workers keep the last tree they opened; a file rewritten in place (other values,
    other baskets) must not be read through the old file's metadata in the next run."""
    import uproot

    path = tmp_path / "in" / "events.root"
    path.parent.mkdir()
    runs = []
    for seed, n in ((1, 30), (2, 40)):
        x = np.random.default_rng(seed).normal(size=n)
        with uproot.recreate(path) as f:
            f["t"] = {"x": x[: n // 2], "i": np.arange(n // 2, dtype=np.int64) + seed * 1000}
            f["t"].extend({"x": x[n // 2:], "i": np.arange(n // 2, n, dtype=np.int64) + seed * 1000})
        out = tmp_path / f"out{seed}"
        rep = ingest_root(IngestRootConfig(input=str(path), tree="t", output=str(out), step_size=7,
                                           schema_dir=str(tmp_path / "schemas")), spark=spark)
        assert rep["rows"] == n and len(rep["files"][0]["parts"]) > 1
        table = _sorted_by_part(out)
        assert table.column("i").to_pylist() == list(range(seed * 1000, seed * 1000 + n))
        assert table.column("x").to_pylist() == x.tolist()
        runs.append(table)


def test_the_chunk_tasks_read_a_planned_file_from_its_basket_map(spark, tmp_path, monkeypatch):
    """The driver plans a file of several chunks and hands each chunk task the basket map of its
    range: the tasks read the flat and jagged branches without opening the tree. Here the TTree's
    metadata is damaged right after planning (the size and modification time kept): a task that
    opened the tree would fail the file, yet every chunk is read, and the rows are uproot's."""
    import awkward as ak
    import uproot

    from pipeline.ingest.root import stage

    path = tmp_path / "in" / "events.root"
    path.parent.mkdir()
    rng = np.random.default_rng(4)
    with uproot.recreate(path, compression=uproot.ZLIB(1)) as f:
        f.mktree("t", {"run": np.uint32, "x": np.float64, "nJ": np.int32, "J_pt": "var * float32"},
                 counter_name=lambda counted: "nJ", field_name=lambda outer, inner: f"J_{inner}")
        for n in (60, 25, 90):
            counts = rng.integers(0, 5, n)
            f["t"].extend({"run": rng.integers(0, 9, n).astype(np.uint32), "x": rng.normal(size=n),
                           "nJ": counts.astype(np.int32),
                           "J_pt": ak.unflatten(rng.normal(size=int(counts.sum())).astype(np.float32), counts)})
    ref = uproot.open(path)["t"].arrays(library="ak")
    copies = [tmp_path / "copies" / f"{i}.root" for i in range(2)]
    copies[0].parent.mkdir()
    for c in copies:
        shutil.copy(path, c)
    key = uproot.open(path).key("t")
    seek, nbytes = key.data_cursor.index, key.data_compressed_bytes
    real_plan = stage.plan_chunks

    def plan_then_damage(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        st = os.stat(path)
        with open(path, "r+b") as fh:                  # the TTree object's compressed bytes
            fh.seek(seek + nbytes // 3)
            fh.write(b"\x00" * (nbytes // 3))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return plan

    monkeypatch.setattr(stage, "plan_chunks", plan_then_damage)
    out = tmp_path / "out"
    rep = ingest_root(IngestRootConfig(input=str(path), tree="t", output=str(out), step_size=50,
                                       schema_dir=str(tmp_path / "schemas")), spark=spark)
    with pytest.raises(BadInputError):                 # the tree cannot be opened any more
        open_tree(str(path), "t")
    assert rep["bad_files"] == [] and rep["rows"] == 175
    assert [p["entry_start"] for p in rep["files"][0]["parts"]] == [0, 60, 85]     # cut at the baskets' edges
    table = _sorted_by_part(out)
    for name in ("run", "x", "nJ", "J_pt"):
        assert table.column(name).to_pylist() == ref[name].tolist(), name
    assert table.schema.field("run").type == pa.uint32()
    monkeypatch.setattr(stage, "plan_chunks", real_plan)
    rep = ingest_root(IngestRootConfig(input=[str(c) for c in copies], tree="t", output=str(tmp_path / "two"),
                                       step_size=50, schema_dir=str(tmp_path / "schemas")), spark=spark)
    assert [len(f["parts"]) for f in rep["files"]] == [3, 3]   # the second file's maps come from its first-pass task
    table = _sorted_by_part(tmp_path / "two")
    assert table.column("J_pt").to_pylist() == ref["J_pt"].tolist() * 2


def test_ingest_nanoaod_all_branches(spark, samples_dir, tmp_path):
    import uproot

    f = samples_dir / "nano_dy.root"
    out = tmp_path / "nano"
    rep = ingest_root(IngestRootConfig(input=str(f), tree="Events", output=str(out),
                                       schema_dir=str(tmp_path / "schemas")), spark=spark)
    t = uproot.open(f)["Events"]
    table = _read(out)
    assert table.num_rows == t.num_entries == 40
    assert len(rep["branches"]) == table.num_columns > 1000
    assert _sorted_by_part(out).column("Muon_pt").to_pylist() == t["Muon_pt"].array().tolist()


def test_bad_missing_and_empty_files(spark, delphes_root, bad_delphes_root, samples_dir, tmp_path):
    colls = H.read_required(delphes_root)
    empty = H.write_delphes_like(tmp_path / "empty.root", colls, empty=True)
    plain = H.write_plain_tree(tmp_path / "plain.root")
    missing = tmp_path / "does_not_exist.root"
    inputs = [str(delphes_root), str(bad_delphes_root), str(samples_dir / "nano_dy.root"), str(empty),
              str(plain), str(missing)]
    out = tmp_path / "events"
    cfg = dict(input=inputs, tree="Delphes", output=str(out), filter_name=["Electron.PT", "Muon.PT", "Muon.Eta"],
               schema_dir=str(tmp_path / "schemas"))
    with pytest.raises(BadInputError) as ei:
        ingest_root(IngestRootConfig(**cfg), spark=spark)
    msg = str(ei.value)
    assert "\n" not in msg and "4 of 6 input file(s) failed" in msg and "bad_delphes.root" in msg
    # the good files were still ingested and the report names every bad file with a reason
    assert _read(out).num_rows == 25
    rep = json.loads((out / "_report.json").read_text())
    reasons = {os.path.basename(b["file"]): b["reason"] for b in rep["bad_files"]}
    assert set(reasons) == {"bad_delphes.root", "nano_dy.root", "plain.root", "does_not_exist.root"}
    assert "no tree 'Delphes'" in reasons["bad_delphes.root"]
    assert "missing branch 'Electron.PT'" in reasons["plain.root"]
    assert "no such file" in reasons["does_not_exist.root"]
    by_name = {os.path.basename(f["file"]): f for f in rep["files"]}
    assert by_name["empty.root"]["rows"] == 0 and by_name["empty.root"]["error"] is None
    # allow_bad_files: same output, no error
    rep = ingest_root(IngestRootConfig(**cfg, allow_bad_files=True), spark=spark)
    assert rep["rows"] == 25 and len(rep["bad_files"]) == 4


def test_only_empty_tree_gives_empty_dataset(spark, delphes_root, tmp_path):
    empty = H.write_delphes_like(tmp_path / "empty.root", H.read_required(delphes_root), empty=True)
    out = tmp_path / "e"
    rep = ingest_root(IngestRootConfig(input=str(empty), tree="Delphes", output=str(out),
                                       schema_dir=str(tmp_path / "schemas")), spark=spark)
    table = _read(out)
    assert rep["rows"] == 0 and table.num_rows == 0 and "Electron.PT" in table.schema.names


def test_all_files_bad_writes_nothing(spark, bad_delphes_root, tmp_path):
    out = tmp_path / "none"
    with pytest.raises(BadInputError, match="no input file could be read"):
        ingest_root(IngestRootConfig(input=str(bad_delphes_root), tree="Delphes", output=str(out),
                                     allow_bad_files=True, schema_dir=str(tmp_path / "s")), spark=spark)
    assert not out.exists()


def test_job_cli(spark, repo, delphes_root, bad_delphes_root, tmp_path, capsys):
    """The job entry point in-process (the shared Spark session is the active one): --dry-run, then a
    run with a broken file: exit code 2 and one error line; the good file is still written."""
    from jobs.ingest_root import main

    out = tmp_path / "cli"
    base = ["--config", str(repo / "configs" / "ingest_root.yaml"), "--output", str(out),
            "--set", f"schema_dir={tmp_path / 'schemas'}"]
    assert main(base + ["--set", "input=samples:delphes.root", "--dry-run"]) == 0   # the default: make run's files
    assert json.loads(capsys.readouterr().out)["plan"]["inputs"][0].endswith("delphes.root")
    rc = main(base + ["--set", f"input=[{delphes_root}, {bad_delphes_root}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("error: 1 of 2 input file(s) failed") and "bad_delphes.root" in err[-1]
    assert _read(out).num_rows == 25 and (out / "_report.json").is_file()


@pytest.mark.slow
def test_every_branch_of_delphes_with_the_type_of_a_real_read(spark, delphes_root, tmp_path):
    """filter_name ["*"]: every branch uproot reads (arrays of ROOT objects included) is converted
    with the type a real read gives, chunk after chunk."""
    import io

    import pyarrow.parquet as pq
    import uproot

    from pipeline.ingest.root import to_arrow

    out = tmp_path / "all"
    rep = ingest_root(IngestRootConfig(input=str(delphes_root), tree="Delphes", output=str(out), step_size=10),
                      spark=spark)
    assert rep["rows"] == 25 and not rep["bad_files"] and len(rep["files"][0]["parts"]) >= 2
    table = _sorted_by_part(out)
    t = uproot.open(delphes_root)["Delphes"]
    assert len(table.column_names) == len(rep["branches"]) > 1000
    for name in ("GenJet.TrimmedP4[5]", "Jet.Constituents", "Event.Number", "EFlowTrack.PT"):
        buf = io.BytesIO()                     # the real read of entries 10-19, through Parquet too
        pq.write_table(to_arrow(t.arrays([name], entry_start=10, entry_stop=20, library="ak")), buf)
        real = pq.read_table(buf).column(0)
        # the same type (nested nullability flags aside) and the same values
        assert str(table.schema.field(name).type).replace(" not null", "") == str(real.type).replace(" not null", "")
        assert table.column(name).slice(10, 10).to_pylist() == real.to_pylist()



def test_first_file_read_for_the_schema_is_written_as_the_other_files(spark, delphes_root, tmp_path):
    """Every branch, files of one chunk each: the driver reads the first file whole for the schema
    and writes that table itself; its part equals the part a Spark task writes for a copy of it,
    and both equal uproot's read."""
    import pyarrow.parquet as pq
    import uproot

    copy = tmp_path / "copy.root"
    copy.symlink_to(delphes_root)
    ref = plan_chunks([str(delphes_root)], "Delphes", ["*"], stop_after_first_good=True, keep_first_chunk=True)
    assert ref.first_table is not None and ref.first_table.num_rows == 25
    out = tmp_path / "all"
    rep = ingest_root(IngestRootConfig(input=[str(delphes_root), str(copy)], tree="Delphes", output=str(out),
                                       schema_dir=str(tmp_path / "schemas")), spark=spark)
    assert rep["rows"] == 50 and not rep["bad_files"]
    assert [[(p["part"], p["entry_start"], p["entry_stop"], p["rows"]) for p in f["parts"]] for f in rep["files"]] == \
        [[("part-f00000-c00000.parquet", 0, 25, 25)], [("part-f00001-c00000.parquet", 0, 25, 25)]]
    first, second = (pq.read_table(out / f"part-f0000{i}-c00000.parquet") for i in (0, 1))
    assert first.schema == second.schema and first.num_columns == len(rep["branches"]) > 1000
    assert first.equals(second)
    t = uproot.open(delphes_root)["Delphes"]
    for name in ("Event.Number", "EFlowTrack.PT", "Jet.BTag"):
        assert first.column(name).to_pylist() == t[name].array(library="ak").tolist()
    del ref, first, second, t
    gc.collect()          # the Delphes object graphs: not in the next test's deadline window

@pytest.mark.timeout(300)                      # a hang fails here, not at the suite's limit
@pytest.mark.parametrize("hang_first", [True, False], ids=["on-the-driver", "in-a-spark-task"])
def test_a_file_that_never_answers_is_reported_after_file_timeout_s(spark, samples_dir, tmp_path, hang_first):
    """A FIFO without a writer blocks its reader forever: the driver (the first file is planned
    there) and a Spark task (the other files) give up after file_timeout_s and report it."""
    hang = tmp_path / "hang.root"
    os.mkfifo(hang)
    good = str(samples_dir / "nano_dy.root")
    out = tmp_path / "out"
    files = [str(hang), good] if hang_first else [good, str(hang)]
    t0 = time.monotonic()
    with pytest.raises(BadInputError, match=f"1 of 2 input file.*{hang}: read timed out after 2 s"):
        ingest_root(IngestRootConfig(input=files, tree="Events", filter_name=["nMuon", "Muon_pt"], output=str(out),
                                     file_timeout_s=2, schema_dir=str(tmp_path / "s")), spark=spark)
    assert time.monotonic() - t0 < 2 + 60
    rep = json.loads((out / "_report.json").read_text())
    assert rep["bad_files"] == [{"file": str(hang), "reason": "read timed out after 2 s"}]
    import uproot
    want = uproot.open(good)["Events"]["nMuon"].array(library="np")
    assert np.array_equal(_read(out).column("nMuon").to_numpy(), want)
    good_index = files.index(good)
    assert sorted(p for p in os.listdir(out) if p.endswith(".parquet")) == [f"part-f{good_index:05d}-c00000.parquet"]


def test_read_deadline_restores_an_outer_timer():
    import signal

    from pipeline.ingest.root import ReadTimeout, read_deadline

    fired = []

    def outer(*a):
        fired.append(1)

    old = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        with read_deadline(5):
            pass
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 25 < left <= 30 and signal.getsignal(signal.SIGALRM) is outer
        with pytest.raises(ReadTimeout, match="read timed out after 0.2 s"):
            with read_deadline(0.2):
                time.sleep(5)
        assert 20 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30 and signal.getsignal(signal.SIGALRM) is outer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert fired == []


@pytest.mark.timeout(300)
def test_feature_stage_reports_a_file_that_never_answers(spark, delphes_root, tmp_path):
    from pipeline.features.stage import FeaturesConfig, build_features

    hang = tmp_path / "hang.root"
    os.mkfifo(hang)
    cfg = FeaturesConfig(input=[str(delphes_root), str(hang)], samples=[{"name": "ttbar", "label": 1, "files": ["*.root"]}],
                         output=str(tmp_path / "out"), file_timeout_s=2)
    with pytest.raises(BadInputError, match=f"1 of 2 input file.*{hang}: read timed out after 2 s"):
        build_features(cfg, spark=spark)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(b["file"], b["reason"]) for b in rep["bad_files"]] == [(str(hang), "read timed out after 2 s")]
    assert {os.path.basename(f["file"]): f["selected"] for f in rep["files"]}["delphes.root"] == 1
