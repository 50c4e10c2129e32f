"""The Spark feature stage with its output on an S3-compatible object store (a real moto S3 server
on loopback, tests/servers.py): the datasets, ``scaling.json`` and ``report.json`` are committed
under the prefix with ``_COMPLETE`` and equal a local run (the tasks write their parts and work
files under the job's prefix on the store; nothing is staged on the driver's disk); a bad target
is one line before any work."""
from __future__ import annotations

import json

import pyarrow.dataset as pads
import pytest

import hep_root_fixtures as H
from pipeline import fs
from pipeline.errors import BadInputError
from pipeline.features.stage import FeaturesConfig, build_features
from pipeline.outputs import COMPLETE_MARKER
from servers import environment, s3_server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="module")
def samples(delphes_root, tmp_path_factory) -> list[dict]:
    """ttbar / wjets Delphes-layout files from the boosted real delphes.root events."""
    base = tmp_path_factory.mktemp("sim")
    colls = H.boosted(H.read_required(delphes_root))
    for name, idx in {"ttbar": list(range(25)), "wjets": list(range(24, -1, -1))}.items():
        (base / name).mkdir()
        H.write_delphes_like(base / name / f"{name}_0000.root", H.take(colls, idx))
    return [{"name": n, "label": i, "files": [f"{base}/{n}/*.root"]} for i, n in enumerate(("ttbar", "wjets"))]


def _cfg(samples, output: str) -> FeaturesConfig:
    return FeaturesConfig(samples=samples, output=output, step_size=10, test_fraction=0.2, val_fraction=0.2, seed=3)


def _rows(path: str, filesystem=None):
    t = pads.dataset(path, format="parquet", filesystem=filesystem, ignore_prefixes=[".", "_"]).to_table()
    return t.sort_by("sample_id").to_pylist()


@pytest.mark.slow
def test_feature_stage_writes_to_the_object_store_like_to_a_local_disk(spark, s3, samples, tmp_path):
    local = build_features(_cfg(samples, str(tmp_path / "features")), spark=spark)
    uri = f"s3://{s3.bucket}/features/run1"
    with environment(**s3.env("writer")):
        remote = build_features(_cfg(samples, uri), spark=spark)
        loc = fs.location(uri)
        names = {f.name for f in fs.list_files(loc)}
        assert {COMPLETE_MARKER, "scaling.json", "report.json"} <= names, names
        assert remote["hlf"] == f"{uri}/hlf" and remote["scaling"] == f"{uri}/scaling.json"
        pfs, root = loc.filesystem(), loc.path
        for name in ("hlf", "llf"):
            assert _rows(f"{root}/{name}", pfs) == _rows(str(tmp_path / "features" / name)), name
        assert json.loads(fs.read_bytes(loc.child("scaling.json"))) == json.loads(
            (tmp_path / "features" / "scaling.json").read_text())
        assert not [p for p in fs.list_files(fs.location(f"s3://{s3.bucket}/features")) if ".tmp-" in str(p)]
    assert remote["splits"] == local["splits"]


def test_feature_stage_refuses_a_bucket_that_does_not_exist_before_any_work(spark, s3, samples):
    with environment(**s3.env("writer")), pytest.raises(BadInputError, match="s3://no-such-bucket/f"):
        build_features(_cfg(samples, "s3://no-such-bucket/f"), spark=spark)


@pytest.mark.slow
def test_feature_stage_reads_an_ingested_dataset_on_the_object_store(spark, s3, samples, tmp_path):
    """The ingested events on the store (the HEP pipeline with output_root=s3://): the feature
    tasks read the parts through pyarrow.fs and give the datasets of the same events read from
    the ROOT files."""
    from pipeline.features.delphes import REQUIRED_BRANCHES
    from pipeline.ingest.root import IngestRootConfig, ingest_root

    local = build_features(_cfg(samples, str(tmp_path / "features")), spark=spark)
    events = f"s3://{s3.bucket}/hep/events"
    with environment(**s3.env("writer")):
        ingest_root(IngestRootConfig(input=[f for s in samples for f in s["files"]], tree="Delphes", output=events,
                                     filter_name=list(REQUIRED_BRANCHES)), spark=spark)
        out = f"s3://{s3.bucket}/hep/features"
        remote = build_features(_cfg(samples, out).model_copy(update={"input": events}), spark=spark)
        loc = fs.location(out)
        for name in ("hlf", "llf"):
            assert _rows(f"{loc.path}/{name}", loc.filesystem()) == _rows(str(tmp_path / "features" / name)), name
    assert remote["splits"] == local["splits"] and [f["written"] for f in remote["files"]] == \
        [f["written"] for f in local["files"]]
