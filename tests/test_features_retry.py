"""Task attempts of the feature stage die or fail while writing (the commit protocol's fault
drills: the first attempt of every task, or of one, dies mid-file or raises after its first
file); Spark retries them (``local[2,4]``) and the stage passes with exactly the output of a run
without faults: nothing of a dead attempt is read or committed (its half-written Parquet part or
work file stays in its own attempt directory, deleted at the commit).

Runs in a process of its own (tests/spark_process.py): task retries need a Spark session that
retries (the suite's shared session, ``local[2]``, fails a job at its first failed task)."""
from __future__ import annotations

import json
import os
import sys

import pyarrow.dataset as pads
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hep_root_fixtures as H  # noqa: E402
from drills import drill, failed_tasks  # noqa: E402

pytestmark = pytest.mark.slow


def run_stage(spark, **cfg) -> dict:
    """The drill: the feature stage with these settings; the committed output's listing and rows."""
    from pipeline.features.stage import FeaturesConfig, build_features

    before = failed_tasks(spark)
    rep = build_features(FeaturesConfig(**cfg), spark=spark)
    out = cfg["output"]
    listing = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    rows = {name: pads.dataset(os.path.join(out, name), format="parquet").to_table().sort_by("sample_id").to_pylist()
            for name in ("hlf", "llf")}
    return {"listing": listing, "rows": rows, "scaling": json.load(open(os.path.join(out, "scaling.json"))),
            "written": sum(f["written"] for f in rep["files"]), "failed_tasks": failed_tasks(spark) - before}


def test_killed_and_failed_task_attempts_leave_the_output_of_a_clean_run(delphes_root, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    colls = H.boosted(H.read_required(delphes_root))
    for i in range(4):
        H.write_delphes_like(src / f"ttbar_{i}.root", H.take(colls, list(range(25))))
    base = {"input": str(src / "*.root"), "samples": [{"name": "ttbar", "label": 1, "files": ["*.root"]}],
            "file_mb": 1, "llf_row_group_mb": 0.05, "balance_classes": True}
    want = drill("test_features_retry:run_stage", base, tmp_path, min_failed=2)   # feature and writer tasks
    assert want["written"] > 10 and any(f.startswith("llf/") for f in want["listing"])
