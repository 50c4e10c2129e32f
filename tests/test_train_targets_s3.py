"""Training targets on an S3-compatible object store (a real moto server on loopback): an output or
checkpoint directory at the root of a bucket is refused with one clear line (its derived names
would be other buckets), and MLflow tracking of a run whose output is on the store logs the run
from the store."""
from __future__ import annotations

import json

import pytest

from pipeline import fs
from servers import environment, s3_server

pytest_plugins = ["train_fixtures"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server, environment(**server.env("writer")):
        yield server


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from train_fixtures import write_digit_shards

    return write_digit_shards(tmp_path_factory.mktemp("shards") / "shards", workers=1, n_train=64, n_test=32,
                              n_val=32, row_group_rows=32)


def _buckets() -> list[str]:
    import pyarrow.fs as pafs

    s3fs = fs.location("s3://any").filesystem()
    return sorted(i.path for i in s3fs.get_file_info(pafs.FileSelector("/", recursive=False)))


def _job(argv, capsys):
    from jobs.train import main

    rc = main(argv)
    return rc, [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]


@pytest.mark.parametrize("target", ["output", "checkpoint_dir"])
def test_a_target_at_the_root_of_a_bucket_is_refused_with_one_line(s3, shards, tmp_path, capsys, target):
    root = f"s3://{s3.bucket}"
    out = root if target == "output" else f"{root}/out"
    before = _buckets(), fs.list_files(fs.location(root))
    argv = ["--manifest", str(shards), "--output", out, "--launcher", "local", "--epochs", "1", "--progress", "false"]
    if target == "checkpoint_dir":
        argv += ["--set", f"checkpoint_dir={root}"]
    rc, err = _job(argv, capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"{root}: the root of a bucket" in err[0] and f"{root}/" in err[0], err[0]  # names a prefix to use
    assert (_buckets(), fs.list_files(fs.location(root))) == before  # no bucket made, nothing written


def test_a_bucket_root_has_no_sibling():
    from pipeline.errors import BadInputError

    with pytest.raises(BadInputError, match="root of a bucket"):
        fs.location("s3://bucket").sibling("bucket-checkpoints")
    assert str(fs.location("s3://bucket/run").sibling("run-checkpoints")) == "s3://bucket/run-checkpoints"
    assert str(fs.location("s3://bucket/a/b").sibling("c")) == "s3://bucket/a/c"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mlflow_tracking_of_a_run_whose_output_is_on_the_store(s3, shards, tmp_path, capsys):
    from mlflow import MlflowClient

    out = f"s3://{s3.bucket}/tracked/train"
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # a database store keeps artifacts in ./mlruns unless the experiment names a place: not the checkout
    MlflowClient(tracking_uri=db).create_experiment("s3-runs", artifact_location=(tmp_path / "artifacts").as_uri())
    rc, err = _job(["--manifest", str(shards), "--output", out, "--launcher", "local", "--epochs", "1",
                    "--batch_size", "16", "--progress", "false", "--set", "tracking.enabled=true",
                    "--set", f"tracking.uri={db}", "--set", "tracking.experiment=s3-runs"], capsys)
    assert rc == 0 and err == [], err
    summary = json.loads(fs.read_bytes(fs.location(f"{out}/summary.json")))
    c = MlflowClient(tracking_uri=db)
    (run,) = c.search_runs([c.get_experiment_by_name("s3-runs").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["pipeline.output"] == out
    assert run.data.metrics["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert {a.path for a in c.list_artifacts(run.info.run_id)} >= {"metrics.jsonl", "summary.json"}
    assert (tmp_path / "artifacts").is_dir()
