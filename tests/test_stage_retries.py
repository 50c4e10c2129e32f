"""Retried task attempts in the ingestion and simulation stages: in a Spark session that retries
tasks (``local[2,4]``, a process of its own: tests/spark_process.py), the first attempt of every
task is killed (``os._exit`` of the Python worker) or fails, mid-write (half of its file written
and closed) or after a complete file; the committed output, on a local path and on a real S3
server (moto, loopback), must equal the output of a run without faults: the same files, the same
rows, none twice, none partial, no job prefix left beside it. Spark's status tracker shows that
the faults fired (failed task attempts in every faulted run, none in the clean ones)."""
from __future__ import annotations

import io
import os
import posixpath
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import fs
from pipeline.commit import COMPLETE_MARKER
from pipeline.committed import committed_files
from servers import environment
from store_fixtures import s3  # noqa: F401
from spark_process import run_drills

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------ run in the drill process
def ingest_root_call(spark, **cfg) -> dict:
    from pipeline.ingest.root import IngestRootConfig, ingest_root

    rep = ingest_root(IngestRootConfig(**cfg), spark=spark)
    return {"rows": rep["rows"], "parts": sorted(p["part"] for f in rep["files"] for p in f["parts"])}


def simulate_call(spark, **cfg) -> dict:
    from pipeline.simulate import SimulateConfig
    from pipeline.simulate.stage import generate

    res = generate(SimulateConfig(**cfg), spark=spark)
    return {"events": res["events"]}


def images_call(spark, **cfg) -> dict:
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images

    return {"rows": ingest_images(ImagesIngestConfig(**cfg), spark=spark)["rows"]}


# ------------------------------------------------------------------------------ the checks
def _names(uri: str) -> list[str]:
    loc = fs.location(uri)
    return sorted(os.path.relpath(f.path, loc.path) for f in fs.list_files(loc))


def _data(uri: str, suffix: str) -> dict[str, bytes]:
    """The committed data files' bytes by name (the marker's list on S3)."""
    loc = fs.location(uri)
    return {os.path.relpath(f.path, loc.path): fs.read_bytes(f) for f in committed_files(uri, suffix)}


def _parquet_rows(uri: str) -> dict[str, pa.Table]:
    loc = fs.location(uri)
    out = {}
    for f in committed_files(uri, ".parquet"):
        with f.filesystem().open_input_file(f.path) as fh:
            out[os.path.relpath(f.path, loc.path)] = pq.read_table(fh)
    return out


def _same_output(faulted: str, clean: str, suffix: str) -> None:
    want = [n for n in _names(clean)]
    assert _names(faulted) == want and COMPLETE_MARKER in want, faulted
    if suffix == ".parquet":
        got, ref = _parquet_rows(faulted), _parquet_rows(clean)
        assert list(got) == list(ref)
        for name in ref:
            assert got[name].equals(ref[name]), name
    else:
        assert _data(faulted, suffix).keys() == _data(clean, suffix).keys()
    assert not _leftovers(faulted), "a job prefix was left"


def _leftovers(uri: str) -> list[str]:
    """Names beside the output that belong to a job's prefix (``.<name>.tmp-<job>``)."""
    loc = fs.location(uri)
    parent = fs.Location(loc.scheme, posixpath.dirname(loc.path))
    return [f.path for f in fs.list_files(parent) if ".tmp-" in f.path]


def _root_arrays(uri: str) -> dict:
    """Every branch of every committed ROOT file, by file name."""
    import awkward as ak
    import uproot

    out = {}
    for name, data in _data(uri, ".root").items():
        with uproot.open(io.BytesIO(data)) as f:
            out[name] = ak.to_list(f["Delphes"].arrays(library="ak"))
    return out


def _ingest_runs(s3, delphes_root, tmp) -> dict:
    """Three copies of delphes.root (25 entries each). step_size=10: the second pass writes 3 parts
    per file (the first attempts die mid-write); step_size=100: each file is one chunk, the first
    written by the driver, the others by first-pass tasks (which fail after a complete part)."""
    src = tmp / "in"
    src.mkdir()
    files = []
    for i in range(3):
        shutil.copy(delphes_root, src / f"d{i}.root")
        files.append(str(src / f"d{i}.root"))
    base = dict(input=files, tree="Delphes", filter_name=["Jet.*", "Electron.PT", "MissingET.MET"],
                schema_dir=str(tmp / "schemas"))
    bucket = f"s3://{s3.bucket}/retries"
    runs = {  # name: (output, step_size, fault)
        "clean10": (str(tmp / "clean10"), 10, None), "clean100": (str(tmp / "clean100"), 100, None),
        "mid-exit": (str(tmp / "mid-exit"), 10, "mid:exit"),
        "after-raise": (str(tmp / "after-raise"), 100, "after:raise"),
        "s3-mid-exit": (f"{bucket}/mid-exit", 10, "mid:exit"),
        "s3-after-exit": (f"{bucket}/after-exit", 100, "after:exit"),
    }
    return {name: ("ingest_root_call", {**base, "output": out, "step_size": step}, fault)
            for name, (out, step, fault) in runs.items()}


def _sim_image_runs(s3, tmp) -> dict:
    """The simulation (ROOT files made in scratch space and copied: the first attempts die
    mid-copy) and the image ingestion (one Parquet file per partition: the first attempts fail
    after a complete file), each beside a clean run of the same config."""
    sim = dict(events=20, events_per_file=10, processes=["wjets"], seed=7, progress=False)
    img = dict(source="sklearn_digits", records_per_part=400)
    bucket = f"s3://{s3.bucket}/retries"
    return {
        "sim-clean": ("simulate_call", {**sim, "output": str(tmp / "sim-clean")}, None),
        "sim-mid-exit": ("simulate_call", {**sim, "output": str(tmp / "sim-mid-exit")}, "mid:exit"),
        "sim-s3": ("simulate_call", {**sim, "output": f"{bucket}/sim"}, "mid:raise"),
        "img-clean": ("images_call", {**img, "output": str(tmp / "img-clean")}, None),
        "img-after-raise": ("images_call", {**img, "output": str(tmp / "img-after-raise")}, "after:raise"),
        "img-s3": ("images_call", {**img, "output": f"{bucket}/img"}, "after:exit"),
    }


@pytest.fixture(scope="module")
def drills(s3, delphes_root, tmp_path_factory) -> tuple[dict, dict]:
    """Every run of this file in one drill process (one Spark start): the runs by name, and what
    each one gave (its result and its failed task attempts)."""
    runs = {**_ingest_runs(s3, delphes_root, tmp_path_factory.mktemp("ingest")),
            **_sim_image_runs(s3, tmp_path_factory.mktemp("sim-images"))}
    calls = [{"call": f"test_stage_retries:{fn}", "kwargs": kw, "fault": fault} for fn, kw, fault in runs.values()]
    return runs, dict(zip(runs, run_drills(calls, env=s3.env("writer"))))


def _check_faults(runs: dict, got: dict, names) -> None:
    for name in names:
        d = got[name]
        assert "result" in d, (name, d)
        assert (d["failed_tasks"] > 0) == (runs[name][2] is not None), (name, d)


def test_ingest_root_retried_attempts(s3, drills):
    runs, got = drills
    names = [n for n in runs if runs[n][0] == "ingest_root_call"]
    assert len(names) == 6
    _check_faults(runs, got, names)
    for name in names:
        assert got[name]["result"]["rows"] == 75, (name, got[name])
    assert got["mid-exit"]["failed_tasks"] >= 9             # every second-pass task (3 files x 3 chunks)
    assert len(got["clean10"]["result"]["parts"]) == 9
    with environment(**s3.env("writer")):
        for name in ("mid-exit", "s3-mid-exit"):
            _same_output(runs[name][1]["output"], runs["clean10"][1]["output"], ".parquet")
        for name in ("after-raise", "s3-after-exit"):
            _same_output(runs[name][1]["output"], runs["clean100"][1]["output"], ".parquet")


def test_simulate_and_images_retried_attempts(s3, drills):
    runs, got = drills
    names = [n for n in runs if runs[n][0] in ("simulate_call", "images_call")]
    assert len(names) == 6
    _check_faults(runs, got, names)
    assert got["sim-mid-exit"]["result"]["events"] == {"wjets": 20}
    assert got["img-after-raise"]["result"]["rows"] == got["img-clean"]["result"]["rows"] == 1797
    with environment(**s3.env("writer")):
        clean = runs["sim-clean"][1]["output"]
        for name in ("sim-mid-exit", "sim-s3"):                  # same seeds: the same events in the same files
            out = runs[name][1]["output"]
            assert _names(out) == _names(clean) and COMPLETE_MARKER in _names(clean), name
            assert _root_arrays(out) == _root_arrays(clean), name
            assert not _leftovers(out), name
        for name in ("img-after-raise", "img-s3"):
            _same_output(runs[name][1]["output"], runs["img-clean"][1]["output"], ".parquet")
