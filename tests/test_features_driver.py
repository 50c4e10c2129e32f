"""The feature stage's driver holds per-file and per-task metadata, counts and histograms, never
per-event arrays: what it receives from its tasks and what it allocates (in Python and in
pyarrow's memory pool, which tracemalloc does not see) do not grow with the events per chunk. The
split decided from those aggregates is exact (per class floor(n * fraction) test and val events)
and the same events get the same split however the input is cut into chunks and tasks."""
from __future__ import annotations

import math
import os
import pickle
import sys

import numpy as np
import pyarrow.dataset as pads
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hep_root_fixtures as H  # noqa: E402
from driver_memory import DriverMemory  # noqa: E402

SAMPLES = [{"name": "qcd", "label": 0, "files": ["*/qcd_*.root"]}, {"name": "ttbar", "label": 1, "files": ["*.root"]}]


@pytest.fixture(scope="module")
def two_sizes(delphes_root, tmp_path_factory):
    """The same 4 files (2 qcd, 2 ttbar) at 25 and at 200 events each."""
    colls = H.boosted(H.read_required(delphes_root))
    out = {}
    for n in (25, 200):
        d = tmp_path_factory.mktemp(f"ev{n}")
        for name in ("qcd_0", "qcd_1", "ttbar_0", "ttbar_1"):
            rng = np.random.default_rng(len(name) + n + int(name[-1]))
            H.write_delphes_like(d / f"{name}.root", H.take(colls, rng.integers(0, 25, n)))
        out[n] = d
    return out


class _Received:
    """Counts the bytes of every task result the driver takes in (``DataFrame.toArrow`` and
    ``collect``, the two ways a stage gathers results), whatever the stage's own code does."""

    def __init__(self, spark, monkeypatch):
        DataFrame = type(spark.range(1))     # the session's DataFrame class (pyspark's classic one)
        self.bytes = 0
        to_arrow, collect = DataFrame.toArrow, DataFrame.collect

        def counted_arrow(df):
            t = to_arrow(df)
            self.bytes += t.nbytes
            return t

        def counted_collect(df):
            rows = collect(df)
            self.bytes += len(pickle.dumps(rows))
            return rows

        monkeypatch.setattr(DataFrame, "toArrow", counted_arrow)
        monkeypatch.setattr(DataFrame, "collect", counted_collect)


def _run(spark, monkeypatch, src, out, **kw):
    """(report, the HLF rows, bytes of task results the driver took in, its DriverMemory)."""
    from pipeline.features.stage import FeaturesConfig, build_features

    got = _Received(spark, monkeypatch)
    cfg = FeaturesConfig(input=str(src / "*.root"), samples=SAMPLES, output=str(out), test_fraction=0.25,
                         val_fraction=0.15, seed=11, **kw)
    try:
        with DriverMemory() as mem:
            rep = build_features(cfg, spark=spark)
    finally:
        monkeypatch.undo()
    t = pads.dataset(rep["hlf"], format="parquet").to_table().to_pandas().sort_values("sample_id")
    return rep, t, got.bytes, mem


def test_driver_receives_no_per_event_arrays_and_the_split_is_exact(spark, two_sizes, tmp_path, monkeypatch):
    _run(spark, monkeypatch, two_sizes[25], tmp_path / "warm")              # imports and caches
    small_rep, _, small, small_mem = _run(spark, monkeypatch, two_sizes[25], tmp_path / "small")
    rep, hlf, big, big_mem = _run(spark, monkeypatch, two_sizes[200], tmp_path / "big")
    sel = sum(f["selected"] for f in rep["files"])
    assert sel - sum(f["selected"] for f in small_rep["files"]) > 100           # 8x the events, same chunks
    assert big - small < 2048, (small, big)                      # not a byte more per event (old: ~370 per event)
    mem = [(m.python, m.arrow) for m in (small_mem, big_mem)]
    assert big_mem.python - small_mem.python < 128 << 10, mem    # nor held by the driver: in Python
    assert big_mem.arrow - small_mem.arrow < 128 << 10, mem      # or in Arrow buffers (a footer read: 64 KiB)
    for lab in (0, 1):       # exact stratified split: per class floor(n * fraction) test and val events
        n = int((hlf.label == lab).sum())
        c = hlf[hlf.label == lab].split.value_counts().to_dict()
        assert (c.get("test", 0), c.get("val", 0)) == (math.floor(n * 0.25), math.floor(n * 0.15)), (lab, n, c)
        assert rep["classes"][str(lab)] == {"train": n - c.get("test", 0) - c.get("val", 0),
                                            "val": c.get("val", 0), "test": c.get("test", 0)}
    # the same events cut into chunks of 7 entries (a second pass, many more tasks) and into LLF
    # files of 1 MB: the same sample_ids, labels, splits and HLF
    _, again, _, _ = _run(spark, monkeypatch, two_sizes[200], tmp_path / "cut", step_size=7, file_mb=1)
    assert again.sample_id.tolist() == hlf.sample_id.tolist() == list(range(sel))
    assert again.label.tolist() == hlf.label.tolist() and again.split.tolist() == hlf.split.tolist()
    np.testing.assert_array_equal(np.stack(again.hlf.to_numpy()), np.stack(hlf.hlf.to_numpy()))
