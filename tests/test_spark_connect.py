"""Spark Connect (issue 37, item 9): what the data stages ask of a session, answered without a
SparkContext, on the suite's shared Spark Connect session (``connect_spark``, tests/conftest.py).
The stages themselves run on it in tests/test_ingest_root.py, test_ingest_images.py,
test_features.py and test_shard.py (the ``any_spark`` and ``connect_spark`` cases)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.config import SparkConfig
from pipeline.errors import ConfigError
from pipeline.spark import (check_executor_python, check_task_slots, default_parallelism, get_spark, is_connect,
                            task_frame)

REPO = Path(__file__).resolve().parents[1]


def test_the_session_is_spark_connect_and_has_no_spark_context(connect_spark, spark):
    assert is_connect(connect_spark) and not is_connect(spark)
    with pytest.raises(Exception, match="sparkContext|NOT_IMPLEMENTED|JVM_ATTRIBUTE"):
        connect_spark.sparkContext   # what a stage must never ask of it
    # the stages' entry (get_spark without a session) picks the active session: this one
    assert get_spark(SparkConfig()) is connect_spark


def test_default_parallelism_is_the_servers_local_master(connect_spark, spark):
    """The server runs local[2] (the shared classic session's master): 2, as the SparkContext says,
    not the session's shuffle partitions (4)."""
    assert default_parallelism(spark) == spark.sparkContext.defaultParallelism == 2
    assert connect_spark.conf.get("spark.sql.shuffle.partitions") == "4"
    assert default_parallelism(connect_spark) == 2


def test_the_executor_probe_runs_on_the_servers_python_workers(connect_spark, monkeypatch):
    """A UDF on the server's Python workers: a module they lack is named in one line; a pass is
    remembered for the application."""
    from pipeline import spark as S

    monkeypatch.setattr(S, "_CHECKED_APPS", set())
    monkeypatch.setattr(S, "EXECUTOR_MODULES", (*S.EXECUTOR_MODULES, "no_such_module_on_the_server"))
    with pytest.raises(ConfigError) as e:
        check_executor_python(connect_spark)
    msg = str(e.value)
    assert "\n" not in msg and "lacks no_such_module_on_the_server;" in msg and "Spark Connect server" in msg, msg
    assert sys.executable in msg                 # the interpreter the server's workers run (this one, here)
    monkeypatch.setattr(S, "EXECUTOR_MODULES", S.EXECUTOR_MODULES[:-1])
    check_executor_python(connect_spark)
    assert S._CHECKED_APPS == {S._app_id(connect_spark)} and S._app_id(connect_spark).startswith("connect:")


def test_task_frame_one_row_per_partition(connect_spark):
    from pyspark.sql import functions as F

    rows = [(i, f"/data/file_{i}.root", 10 * i) for i in range(5)]
    df = task_frame(connect_spark, rows, "file_index int, path string, entries long")
    assert sorted(tuple(r) for r in df.collect()) == rows
    parts = df.select(F.spark_partition_id().alias("p"), "file_index").collect()
    assert len({r.p for r in parts}) == 5                    # one descriptor per partition

    def rows_per_partition(it):                              # nested: pickled by value for the server
        import pyarrow as pa

        n = sum(b.num_rows for b in it)
        yield pa.RecordBatch.from_pylist([{"n": n}])

    assert [r.n for r in df.mapInArrow(rows_per_partition, "n long").collect()] == [1] * 5


def test_training_on_spark_connect_is_one_line_naming_the_classic_session(connect_spark, tmp_path):
    """The Spark launchers run barrier tasks through the SparkContext: one ConfigError line before
    anything starts, from the slot check and from the launch itself."""
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import run_workers

    with pytest.raises(ConfigError) as e:
        check_task_slots(connect_spark, 2)
    msg = str(e.value)
    assert "\n" not in msg and "classic Spark session" in msg and "Spark Connect" in msg
    cfg = TrainConfig(launcher="torch", manifest=str(tmp_path / "manifest.json"), output=str(tmp_path / "t"))
    with pytest.raises(ConfigError, match=r"launcher=torch needs a classic Spark session.*spark\.remote"):
        run_workers(cfg, {"workers": 2}, str(tmp_path / "t"), str(tmp_path / "ck"), spark=connect_spark)


def test_remote_setting_is_checked_and_a_local_server_beside_a_classic_session_is_one_line(spark):
    assert SparkConfig(remote="sc://spark.example.org:15002").remote == "sc://spark.example.org:15002"
    for bad in ("http://host:15002", "local[x]", "yarn"):
        with pytest.raises(ValidationError, match="remote"):
            SparkConfig(remote=bad)
    # builder.remote("local[2]") would start a second Spark in a process that runs a classic one
    with pytest.raises(ConfigError) as e:
        get_spark(SparkConfig(remote="local[2]"))
    assert "\n" not in str(e.value) and "sc://" in str(e.value)
    assert not is_connect(get_spark(SparkConfig()))          # the classic session is still the active one


@pytest.mark.slow   # starts its own Spark Connect server (a JVM of its own, as a user's job does): 25-50 s
def test_a_job_with_spark_remote_local_runs_on_a_connect_server_it_starts(delphes_root, tmp_path):
    """``--set spark.remote=local[2]`` as a user types it: the job starts a Spark Connect server
    (``SparkSession.builder.remote``) in its process and ingests through it; the rows are uproot's."""
    import pyarrow.dataset as pads
    import uproot

    out = tmp_path / "events"
    code = ("import sys\n"
            "from pyspark.sql import SparkSession\n"
            "from jobs.ingest_root import main\n"
            "rc = main(sys.argv[1:])\n"
            "s = SparkSession.getActiveSession()\n"
            "print('SESSION', type(s).__module__)\n"
            "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code, "--input", str(delphes_root), "--tree", "Delphes",
                        "--output", str(out), "--set", "filter_name=[Jet.PT, MissingET.MET]",
                        "--set", "step_size=10", "--set", "spark.remote=local[2]",
                        "--set", f"schema_dir={tmp_path / 'schemas'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "SESSION pyspark.sql.connect.session" in r.stdout.splitlines(), r.stdout[-2000:]
    assert any(ln.startswith("SUMMARY ingest_root: ") for ln in r.stdout.splitlines()), r.stdout[-2000:]
    table = pads.dataset(str(out), format="parquet", ignore_prefixes=[".", "_"]).to_table()
    t = uproot.open(delphes_root)["Delphes"]
    assert table.num_rows == 25
    assert sorted(table.column("MissingET.MET").to_pylist()) == sorted(t["MissingET.MET"].array(library="ak").tolist())
    assert json.loads((out / "_report.json").read_text())["rows"] == 25


@pytest.mark.slow   # Pythia 8 starts in each of 2 Spark tasks and once more for the rerun: 20-50 s
def test_simulation_on_spark_connect_writes_each_tasks_seeded_events(connect_spark, tmp_path):
    """The simulation's tasks through mapInArrow (no RDD, no accumulator): every file is committed,
    in task order, and holds exactly the events of its task rerun outside Spark with its seeds."""
    import awkward as ak
    import numpy as np
    import uproot

    from pipeline.commit import JobTarget
    from pipeline.simulate.config import SimulateConfig
    from pipeline.simulate.stage import generate, make_tasks, run_task

    cfg = SimulateConfig(processes=["wjets"], events=12, events_per_file=6, seed=11, output=str(tmp_path / "sim"),
                         progress=False)
    res = generate(cfg, spark=connect_spark)
    tasks = make_tasks(cfg)
    assert res["events"] == {"wjets": 12}
    assert res["files"]["wjets"] == [str(tmp_path / "sim" / t["file"]) for t in tasks]
    r = run_task(tasks[1], cfg, JobTarget(str(tmp_path / "again")))
    again = JobTarget(str(tmp_path / "again")).file(r["attempt_dir"], tasks[1]["file"]).path
    a, b = uproot.open(res["files"]["wjets"][1])["Delphes"], uproot.open(again)["Delphes"]
    for name in ("EFlowTrack.PT", "MissingET.MET", "Event.Number"):
        x, y = a[name].array(), b[name].array()
        assert np.array_equal(ak.to_numpy(ak.flatten(x, axis=None)), ak.to_numpy(ak.flatten(y, axis=None))), name


@pytest.mark.slow   # plans in a Python worker of the server, then 3 read tasks: over 20 s on a loaded 2-core host
def test_the_root_data_source_on_spark_connect(connect_spark, delphes_root):
    """``spark.read.format("root")`` registered on a Connect session: the server plans the chunks
    and reads them in its Python workers; the values are uproot's."""
    import uproot

    from pipeline.ingest.datasource import register

    register(connect_spark)
    df = (connect_spark.read.format("root").option("tree", "Delphes").option("filter_name", "MissingET.MET")
          .option("step_size", "10").load(str(delphes_root)))
    rows = df.collect()
    want = uproot.open(delphes_root)["Delphes"]["MissingET.MET"].array(library="ak").tolist()
    assert len(rows) == 25 and sorted(v for r in rows for v in r["MissingET.MET"]) == sorted(v for w in want for v in w)
