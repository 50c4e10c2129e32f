"""Outputs on an S3-compatible object store (a real moto S3 server on loopback) and remote ROOT
inputs over XRootD (a real xrootd server on loopback): the filesystem layer every stage writes through."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import fs, outputs
from pipeline.errors import BadInputError
from servers import environment, s3_server, xrootd_server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def s3_env(s3):
    with environment(**s3.env("writer")):
        yield s3


def _write_tree(tmp: Path, text: str) -> None:
    (tmp / "sub").mkdir()
    (tmp / "a.txt").write_text(text)
    (tmp / "sub" / "b.txt").write_text(text * 2)


def _keys(uri: str) -> list[str]:
    loc = fs.location(uri)
    return [f.path[len(loc.path) + 1:] for f in fs.list_files(loc)]


def test_location_parsing_and_spark_translation():
    assert fs.location("s3://b/k/x").spark_uri() == "s3a://b/k/x"
    assert fs.location("s3a://b/k/x") == fs.location("s3://b/k/x")
    assert fs.location("file:///tmp/a").spark_uri() == "file:///tmp/a"
    assert fs.location("rel/x").is_local and Path(fs.location("rel/x").path).is_absolute()
    root = fs.location("root://host:1094//eos/f.root")
    assert root.scheme == "root" and str(root) == "root://host:1094//eos/f.root"
    for bad, needle in (("gs://b/x", "gs:// is not supported"), ("s3:///x", "needs a bucket")):
        with pytest.raises(BadInputError, match=needle):
            fs.location(bad, output=True)
    with pytest.raises(BadInputError, match="root:// is not supported for outputs"):
        fs.location("root://h//x", output=True)


def test_atomic_output_commits_with_marker_and_replaces_previous(s3_env):
    uri = f"s3://{s3_env.bucket}/commit/out"
    with outputs.atomic_output_dir(uri) as tmp:
        _write_tree(tmp, "one")
    assert _keys(uri) == [outputs.COMPLETE_MARKER, "a.txt", "sub/b.txt"]
    marker = json.loads(fs.read_bytes(fs.location(uri).child(outputs.COMPLETE_MARKER)))
    assert sorted(marker["files"]) == ["a.txt", "sub/b.txt"]
    with outputs.atomic_output_dir(uri) as tmp:            # a rerun replaces the whole prefix
        (tmp / "c.txt").write_text("two")
    assert _keys(uri) == [outputs.COMPLETE_MARKER, "c.txt"]
    assert outputs.require_complete(uri) == fs.location(uri)
    # nothing else left beside the output (no temporary prefix, no write probe)
    assert _keys(f"s3://{s3_env.bucket}/commit") == [f"out/{k}" for k in _keys(uri)]


def test_failed_write_leaves_previous_output_untouched(s3_env):
    uri = f"s3://{s3_env.bucket}/failing/out"
    with outputs.atomic_output_dir(uri) as tmp:
        _write_tree(tmp, "good")
    before = {k: fs.read_bytes(fs.location(uri).child(k)) for k in _keys(uri)}
    with pytest.raises(RuntimeError, match="boom"):
        with outputs.atomic_output_dir(uri) as tmp:
            (tmp / "partial.txt").write_text("half")
            raise RuntimeError("boom")
    assert {k: fs.read_bytes(fs.location(uri).child(k)) for k in _keys(uri)} == before
    assert _keys(f"s3://{s3_env.bucket}/failing") == [f"out/{k}" for k in sorted(before)]


def test_incomplete_prefix_is_refused(s3_env):
    uri = f"s3://{s3_env.bucket}/out/half-written"
    fs.write_bytes(fs.location(uri).child("part-0.parquet"), b"x")
    with pytest.raises(BadInputError, match="incomplete .*_COMPLETE"):
        outputs.require_complete(uri)
    with pytest.raises(BadInputError, match="not found"):
        outputs.require_complete(f"s3://{s3_env.bucket}/out/never-written")


def test_json_round_trip(s3_env):
    uri = f"s3://{s3_env.bucket}/meta/scaling.json"
    outputs.write_json(uri, {"mean": [1.5, 2.5]})
    assert outputs.read_json(uri) == {"mean": [1.5, 2.5]}
    fs.write_bytes(fs.location(uri), b"{not json")
    with pytest.raises(BadInputError, match="scaling.json is not valid JSON"):
        outputs.read_json(uri)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_read_bytes_if_exists(s3_env, tmp_path, where):
    """The object's bytes, or None for a missing one and for a prefix/directory (no object)."""
    root = str(tmp_path) if where == "local" else f"s3://{s3_env.bucket}/rbie"
    fs.write_bytes(fs.location(f"{root}/d/x.bin"), b"\x00payload")
    assert fs.read_bytes_if_exists(fs.location(f"{root}/d/x.bin")) == b"\x00payload"
    assert fs.read_bytes_if_exists(fs.location(f"{root}/d/missing.bin")) is None
    assert fs.read_bytes_if_exists(fs.location(f"{root}/nowhere/x.bin")) is None
    assert fs.read_bytes_if_exists(fs.location(f"{root}/d")) is None


@pytest.mark.parametrize("case", ["no-bucket", "read-only", "no-credentials", "bad-key"])
def test_bad_object_store_targets_are_one_line_and_write_nothing(s3, case):
    env = s3.env("reader" if case == "read-only" else "writer")
    uri = f"s3://{s3.bucket}/denied/out"
    expect = {"read-only": "not writable: access denied", "bad-key": "access denied",
              "no-credentials": "no S3 credentials"}
    if case == "no-bucket":
        uri, expect[case] = "s3://no-such-bucket/out", "bucket 'no-such-bucket' does not exist"
    if case == "no-credentials":
        env.update(AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    if case == "bad-key":
        env.update(AWS_ACCESS_KEY_ID="AKIAUNKNOWN", AWS_SECRET_ACCESS_KEY="wrong")
    entered = []
    with environment(**env):
        with pytest.raises(BadInputError) as err:
            with outputs.atomic_output_dir(uri):
                entered.append(True)
        assert expect[case] in str(err.value) and "\n" not in str(err.value)
        assert str(err.value).startswith(uri.split("/out")[0])
    assert entered == []                                    # refused before any work
    with environment(**s3.env("writer")):
        assert _keys(f"s3://{s3.bucket}/denied") == []


@pytest.mark.needs_petastorm
def test_petastorm_reads_a_shard_from_the_object_store(s3_env):
    from petastorm import make_batch_reader

    from pipeline.data.petastorm_fs import petastorm_filesystem

    uri = f"s3://{s3_env.bucket}/shards/worker_000"
    rows = np.arange(600, dtype=np.float32).reshape(-1, 1) + np.arange(14, dtype=np.float32)
    with outputs.atomic_output_dir(uri) as tmp:
        pq.write_table(pa.table({"sample_id": pa.array(np.arange(600)),
                                 "hlf": pa.array(list(rows), type=pa.list_(pa.float32()))}),
                       tmp / "part-0.parquet", row_group_size=100)
    url, filesystem = petastorm_filesystem(outputs.require_complete(uri))
    got = []
    with make_batch_reader(url, filesystem=filesystem, reader_pool_type="thread", workers_count=2,
                           num_epochs=1, shuffle_row_groups=False) as reader:
        for b in reader:
            got.extend(zip(b.sample_id.tolist(), np.stack(b.hlf).tolist()))
    got.sort()
    assert [i for i, _ in got] == list(range(600))
    assert np.array_equal(np.array([h for _, h in got], np.float32), rows)


def test_uproot_reads_root_over_xrootd(tmp_path, samples_dir):
    import shutil

    import uproot

    export = tmp_path / "export"
    export.mkdir()
    shutil.copy(samples_dir / "nano_dy.root", export / "nano_dy.root")
    with xrootd_server(export, tmp_path) as xrd:
        url = xrd.url(export / "nano_dy.root")
        assert fs.location(url).scheme == "root"
        with uproot.open(url, timeout=fs.remote_root_timeout()) as f:
            remote = f["Events"].arrays(["Muon_pt", "nMuon"], library="np")
    with uproot.open(samples_dir / "nano_dy.root") as f:
        local = f["Events"].arrays(["Muon_pt", "nMuon"], library="np")
    assert np.array_equal(remote["nMuon"], local["nMuon"])
    assert all(np.array_equal(a, b) for a, b in zip(remote["Muon_pt"], local["Muon_pt"]))
