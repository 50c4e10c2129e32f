"""The task plumbing every stage shares (pipeline/spark.py): descriptor frames with one row per
partition, the Python-worker start-up fix and the task-slot sizing, on the suite's real local
Spark session."""
from __future__ import annotations

import os
import sys
import zipfile
import zipimport

import pytest

from pipeline.errors import ConfigError
from pipeline.spark import (check_task_slots, local_master, python_worker_setup, spark_task, task_frame,
                            task_slots)


def test_task_frame_one_row_per_partition(spark):
    rows = [(i, f"/data/file_{i}.root", 10 * i) for i in range(7)]
    df = task_frame(spark, rows, "file_index int, path string, entries long")
    assert df.columns == ["file_index", "path", "entries"]
    assert df.rdd.getNumPartitions() == 7
    assert sorted(tuple(r) for r in df.collect()) == rows
    def rows_per_partition(it):                     # nested: pickled by value for the workers
        import pyarrow as pa

        n = sum(b.num_rows for b in it)
        yield pa.RecordBatch.from_pylist([{"n": n}])

    counts = [r.n for r in df.mapInArrow(rows_per_partition, "n long").collect()]
    assert counts == [1] * 7


def test_task_frame_empty(spark):
    df = task_frame(spark, [], "chunk_id int, path string")
    assert df.columns == ["chunk_id", "path"] and df.count() == 0


def test_worker_zip_directories_are_not_reread(spark):
    """PySpark workers import pyspark from pyspark.zip; after the first task of a worker an
    unchanged archive is not re-read at each importlib.invalidate_caches()."""
    df = spark.range(0, 4, 1, 2)

    def zip_rereads(it):
        """In a worker: how often a zipimporter re-reads its archive over two invalidations."""
        import importlib

        import pyarrow as pa

        reads = 0
        original = zipimport._read_directory

        def counting(archive):
            nonlocal reads
            reads += 1
            return original(archive)

        zipimport._read_directory = counting
        try:
            for _ in it:
                pass
            importlib.invalidate_caches()
            importlib.invalidate_caches()
        finally:
            zipimport._read_directory = original
        yield pa.RecordBatch.from_pylist([{"reads": reads, "zips": sum(".zip" in p for p in sys.path)}])

    for _ in range(2):                              # the second run's workers are patched
        got = df.mapInArrow(spark_task(zip_rereads), "reads long, zips long").collect()
    assert all(r.zips > 0 for r in got), got        # the premise: zips on the workers' sys.path
    assert all(r.reads == 0 for r in got), got


def test_changed_archive_is_reread(tmp_path):
    """The stat guard keeps the semantics: a rewritten archive is read again."""
    archive = tmp_path / "mod.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("alpha.py", "X = 1\n")
    python_worker_setup()
    imp = zipimport.zipimporter(str(archive))
    imp.invalidate_caches()                         # first call records the stamp
    assert imp.find_spec("alpha") is not None and imp.find_spec("beta") is None
    imp.invalidate_caches()                         # unchanged: kept
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("beta.py", "Y = 2\n")
        z.writestr("padding.txt", "x" * 100)
    imp.invalidate_caches()
    assert imp.find_spec("beta") is not None and imp.find_spec("alpha") is None


# --------------------------------------------------------------------------- local sizing
@pytest.mark.parametrize("master,want,expected", [
    ("local", 4, "local[4]"), ("local[2]", 4, "local[4]"), ("local[8]", 4, "local[8]"),
    ("local[2,3]", 4, "local[4,3]"), ("local[2]", None, "local[2]"),
    ("spark://host:7077", 4, "spark://host:7077"), ("yarn", 4, "yarn"),
])
def test_local_master_gets_enough_task_slots(master, want, expected):
    assert local_master(master, want) == expected


def test_local_star_keeps_all_cores_or_grows_to_the_workers():
    n = os.cpu_count() or 1
    assert local_master("local[*]", n) == "local[*]"
    assert local_master("local[*]", n + 3) == f"local[{n + 3}]"


def test_slot_check_fails_at_once_naming_workers_and_slots(spark):
    assert task_slots(spark) == 2                         # the shared local[2] session
    assert check_task_slots(spark, 2) == 2
    with pytest.raises(ConfigError) as e:
        check_task_slots(spark, 3)
    msg = str(e.value)
    assert "\n" not in msg and "workers=3" in msg and "has 2" in msg and "local[2]" in msg


@pytest.mark.parametrize("value,seconds", [("30s", 30.0), ("2min", 120.0), ("500ms", 0.5), ("45", 45.0), ("1h", 3600.0)])
def test_spark_time_settings_in_seconds(value, seconds):
    from pipeline.spark import _seconds

    assert _seconds(value) == seconds
