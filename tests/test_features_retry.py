"""A writer task of the feature stage dies mid-write (its Python worker exits while its Parquet
file is half written); Spark retries it (``local[2,2]``: two attempts per task) and the stage
must pass, with nothing of the dead attempt left in the output.

Runs in its own process: task retries need a Spark session of their own (the suite's shared
session, ``local[2]``, gives every task one attempt)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hep_root_fixtures as H  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

# the driver of the run: the writer task's first attempt of partition 0 writes one row group and
# kills its Python worker (no finally, no close), as a lost executor would
_DRIVER = r'''
import json, os, sys
from pipeline.config import SparkConfig
from pipeline.features import writers
from pipeline.features.stage import FeaturesConfig, build_features
from pipeline.spark import get_spark

marks = sys.argv[2]
real = writers.write_partition


def dies_once(batches, **kw):
    from pyspark import TaskContext
    import pyarrow.parquet as pq

    tc = TaskContext.get()
    open(os.path.join(marks, f"p{tc.partitionId()}-a{tc.attemptNumber()}"), "w").close()
    if tc.attemptNumber() == 0 and tc.partitionId() == 0:
        write = pq.ParquetWriter.write_table

        def die(self, *a, **k):
            write(self, *a, **k)
            os._exit(3)
        pq.ParquetWriter.write_table = die
    yield from real(batches, **kw)


writers.write_partition = dies_once
spark = get_spark(SparkConfig(master="local[2,2]", app_name="features-retry", driver_memory="1g"))
rep = build_features(FeaturesConfig(**json.loads(sys.argv[1])), spark=spark)
print("REPORT " + json.dumps({"llf": rep["llf"], "written": sum(f["written"] for f in rep["files"])}))
spark.stop()
'''


def test_a_writer_task_killed_mid_write_is_retried_and_leaves_nothing(delphes_root, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    colls = H.boosted(H.read_required(delphes_root))
    for i in range(4):
        H.write_delphes_like(src / f"ttbar_{i}.root", H.take(colls, list(range(25))))
    marks = tmp_path / "attempts"
    marks.mkdir()
    cfg = {"input": str(src / "*.root"), "samples": [{"name": "ttbar", "label": 1, "files": ["*.root"]}],
           "output": str(tmp_path / "out"), "file_mb": 1, "llf_row_group_mb": 0.05}
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    p = subprocess.run([sys.executable, str(script), json.dumps(cfg), str(marks)], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert {"p0-a0", "p0-a1"} <= {m.name for m in marks.iterdir()}, sorted(os.listdir(marks))  # it was retried
    rep = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("REPORT "))[7:])
    for d in (rep["llf"], rep["llf"].replace("/llf", "/hlf")):
        names = sorted(os.listdir(d))
        assert names and all(n.startswith("part-") and n.endswith(".parquet") for n in names), names
        rows = [pq.read_table(os.path.join(d, n), columns=["sample_id"]).column(0).to_pylist() for n in names]
        ids = [i for r in rows for i in r]
        assert len(ids) == len(set(ids)) == rep["written"] > 10
