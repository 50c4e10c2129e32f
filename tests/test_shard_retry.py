"""Task attempts of the shard stage die or fail while writing (the commit protocol's fault
drills: the first attempt of every writer task dies mid-file, or raises after its first file);
Spark retries them (``local[2,4]``) and the committed shards are byte for byte those of a run
without faults. Runs in a process of its own (tests/spark_process.py)."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from drills import drill, failed_tasks  # noqa: E402

pytestmark = pytest.mark.slow


def run_shard(spark, **cfg) -> dict:
    """The drill: the shard stage; the committed files and their digests, the failed task attempts."""
    from pipeline.shards.materialize import ShardConfig, shard

    before = failed_tasks(spark)
    shard(ShardConfig(**cfg), spark)
    out = cfg["output"]
    digests = {}
    for d, _, names in os.walk(out):
        for n in names:
            if n == "_COMPLETE":          # names the job (a new id each run): its file list is checked below
                continue
            p = os.path.join(d, n)
            text = open(p, "rb").read().replace(out.encode(), b"OUT")       # the manifest names its own paths
            digests[os.path.relpath(p, out)] = hashlib.sha256(text).hexdigest()
    listed = json.loads(open(os.path.join(out, "_COMPLETE")).read())["files"]
    assert sorted(listed) == sorted(digests), (listed, sorted(digests))     # the marker lists every file
    return {"files": digests, "failed_tasks": failed_tasks(spark) - before}


def test_killed_and_failed_writer_attempts_leave_the_shards_of_a_clean_run(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    rng = np.random.default_rng(0)
    n = 600
    t = pa.table({"sample_id": np.arange(n), "label": rng.integers(0, 3, n),
                  "split": rng.choice(["train", "val", "test"], n, p=[0.8, 0.1, 0.1]),
                  "hlf": pa.array(rng.normal(size=(n, 14)).astype(np.float32).tolist(), pa.list_(pa.float32()))})
    for f in range(3):
        pq.write_table(t.slice(200 * f, 200), src / f"part-{f}.parquet", row_group_size=50)
    base = {"input": str(src), "scheme": "medium_coarse", "workers": 4, "copies": 2, "row_group_rows": 16}
    want = drill("test_shard_retry:run_shard", base, tmp_path, min_failed=1)
    assert len([f for f in want["files"] if f.startswith("worker_")]) == 4 and "manifest.json" in want["files"]
