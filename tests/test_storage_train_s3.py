"""Training with its output and checkpoints on an S3-compatible object store (a real moto S3 server
on loopback, IAM enforced): the output is committed with ``_COMPLETE`` and no temporary prefix is
left, every checkpoint is a set of rank objects plus ``meta.json`` written last, a killed run
resumes from the newest complete checkpoint on the store and ends bit-identical to an
uninterrupted run, a lost worker is relaunched from the store, the learning-curve report reads
runs from and writes its PNG to the store, and bad targets (missing bucket, missing credentials,
read-only user, an unsupported scheme) are one line, exit code 2, nothing written."""
from __future__ import annotations

import json
import posixpath

import pytest

from pipeline import fs, outputs
from pipeline.train.config import TrainConfig
from servers import environment, s3_server

pytest_plugins = ["train_fixtures"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from train_fixtures import write_digit_shards

    return write_digit_shards(tmp_path_factory.mktemp("shards") / "shards", workers=2, n_train=256, n_test=64,
                              n_val=32, row_group_rows=32)


def _keys(uri: str) -> list[str]:
    loc = fs.location(uri)
    return [f.path[len(loc.path) + 1:] for f in fs.list_files(loc)]


def _base(man, **kw):
    d = dict(manifest=str(man), launcher="local", epochs=2, batch_size=16, optimizer="sgd", lr=0.05,
             checkpoint_every=5, progress=False)
    d.update(kw)
    return d


@pytest.fixture(scope="module")
def reference(s3, shards):
    """The uninterrupted run, output and checkpoints on the store."""
    from pipeline.train.launch import train

    b = f"s3://{s3.bucket}/train"
    with environment(**s3.env("writer")):
        return train(TrainConfig(output=f"{b}/ref", checkpoint_dir=f"{b}/ref-ck", **_base(shards)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_output_and_checkpoints_on_s3_and_a_killed_run_resumes_from_the_store(s3, shards, reference):
    from pipeline.train import checkpoint
    from pipeline.train.launch import train
    from pipeline.train.restart import TrainingFailed

    b = f"s3://{s3.bucket}/train"
    ref = reference
    with environment(**s3.env("writer")):
        assert ref["steps"] == 16 and ref["metrics"] == f"{b}/ref/metrics.jsonl"
        assert sorted(_keys(f"{b}/ref")) == [outputs.COMPLETE_MARKER, "metrics.jsonl", "model.pt", "summary.json"]
        assert json.loads(fs.read_bytes(fs.location(f"{b}/ref/summary.json")))["final_digests"] == ref["final_digests"]
        ck = _keys(f"{b}/ref-ck")
        assert {k.split("/")[0] for k in ck} == {"step_00000010", "step_00000015", "step_00000016"}  # keep=3
        assert [k for k in ck if k.startswith("step_00000016/")] == [
            "step_00000016/meta.json", "step_00000016/rank_000.pt", "step_00000016/rank_001.pt"]
        assert ref["checkpoint"] == f"{b}/ref-ck/step_00000016"

        # a worker killed at step 12, no restart allowed: nothing under the output, checkpoint 10 on the store
        with pytest.raises(TrainingFailed, match=r"step_00000010"):
            train(TrainConfig(output=f"{b}/run", checkpoint_dir=f"{b}/run-ck", max_restarts=0,
                              debug={"fail_at_step": 12, "fail_rank": 1, "fail_mode": "kill"}, **_base(shards)))
        assert _keys(f"{b}/run") == []
        # a newer checkpoint whose meta.json never arrived is skipped: the resume takes step 10
        fs.write_bytes(fs.location(f"{b}/run-ck/step_00000014/rank_000.pt"), b"partial")
        assert str(checkpoint.newest_complete(f"{b}/run-ck")[0]) == f"{b}/run-ck/step_00000010"
        run = train(TrainConfig(output=f"{b}/run", checkpoint_dir=f"{b}/run-ck", resume=True, **_base(shards)))
    assert run["resumed_from"] == f"{b}/run-ck/step_00000010" and run["steps"] == 16
    assert run["final_digests"] == ref["final_digests"]  # bit-identical to the uninterrupted run
    assert run["test_accuracy"] == ref["test_accuracy"]
    with environment(**s3.env("reader")):
        # everything at the top of the bucket is a committed output or a checkpoint: no temporary prefix, no probe
        top = {k.split("/")[0] for k in _keys(b)}
        assert top <= {"ref", "ref-ck", "run", "run-ck", "lost", "lost-ck", "report"}
        assert not [t for t in top if t.startswith(".")]
        assert outputs.require_complete(f"{b}/run") == fs.location(f"{b}/run")
        assert "step_00000014" not in {k.split("/")[0] for k in _keys(f"{b}/run-ck")}  # pruned as a leftover
    # the learning-curve report reads both runs from the store and PUTs its PNG there
    from pipeline.report.curves import ReportConfig, report

    with environment(**s3.env("writer")):
        r = report(ReportConfig(runs=[f"{b}/ref", f"{b}/run/metrics.jsonl"], output=f"{b}/report/curves.png"))
        assert r == {"output": f"{b}/report/curves.png", "runs": 2}
        assert fs.read_bytes(fs.location(f"{b}/report/curves.png"))[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_worker_is_relaunched_from_the_checkpoint_on_the_store(s3, shards, reference):
    from pipeline.train.launch import train

    b = f"s3://{s3.bucket}/train"
    with environment(**s3.env("writer")):
        run = train(TrainConfig(output=f"{b}/lost", checkpoint_dir=f"{b}/lost-ck",
                                debug={"fail_at_step": 12, "fail_rank": 0, "fail_mode": "kill"}, **_base(shards)))
        (r,) = run["restarts"]
        assert r["checkpoint"] == f"{b}/lost-ck/step_00000010" and r["from_step"] == 10 and r["worker"] == 0
        assert run["final_digests"] == reference["final_digests"]
        summary = json.loads(fs.read_bytes(fs.location(f"{b}/lost/summary.json")))
        assert summary["restarts"] == [r]


def _job(argv, capsys):
    from jobs.train import main

    rc = main(argv)
    return rc, [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]


@pytest.mark.parametrize("case", ["no-bucket-output", "no-bucket-checkpoints", "no-credentials", "reader",
                                  "scheme", "tracking"])
def test_bad_targets_are_one_line_exit_2_and_nothing_written(s3, shards, tmp_path, capsys, case):
    b = f"s3://{s3.bucket}/bad-{case}"
    local_out = tmp_path / "out"
    output, ck, user, env, needle = {
        "no-bucket-output": ("s3://no-such-bucket/out", None, "writer", {},
                             "the bucket 'no-such-bucket' does not exist"),
        "no-bucket-checkpoints": (str(local_out), "s3://no-such-bucket/ck", "writer", {},
                                  "the bucket 'no-such-bucket' does not exist"),
        "no-credentials": (f"{b}/out", None, "writer", {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""},
                           "no S3 credentials"),
        "reader": (f"{b}/out", None, "reader", {}, "not writable: access denied"),
        "scheme": ("gs://bucket/out", None, "writer", {}, "gs:// is not supported for outputs"),
        "tracking": (f"{b}/out", None, "writer", {}, "MLflow's default file store is local; set tracking.uri"),
    }[case]
    argv = ["--manifest", str(shards), "--output", output, "--launcher", "local", "--epochs", "1",
            "--batch_size", "16", "--progress", "false"] + (["--checkpoint_dir", ck] if ck else []) + (
            ["--tracking.enabled", "true"] if case == "tracking" else [])
    with environment(**{**s3.env(user), **env}):
        rc, err = _job(argv, capsys)
    assert rc == 2 and len(err) == 1, err
    uri = ck or output
    assert uri in err[0] and needle in err[0], err[0]
    with environment(**s3.env("writer")):
        assert _keys(f"s3://{s3.bucket}/bad-{case}") == []
    assert not local_out.exists()


def test_an_output_without_rank_0_files_is_never_committed(s3, tmp_path):
    """The driver commits only when rank 0's files are where it reads them: a local output that
    rank 0 wrote on another machine's disk is one line and nothing is committed (the cluster case:
    tests/test_cluster_isolated.py). Only the last launch's files are committed."""
    from pipeline.commit import output_job
    from pipeline.errors import ConfigError
    from pipeline.train.launch import _keep_rank0_files, launch_dir

    for final in (str(tmp_path / "out"), f"s3://{s3.bucket}/check/out"):
        with environment(**s3.env("writer")):
            with pytest.raises(ConfigError, match=r"rank 0 reported success but its model.pt is not under "):
                with output_job(final) as job:
                    fs.write_bytes(job.staging.child(launch_dir(0), "metrics.jsonl"), b"{}\n")
                    _keep_rank0_files(job, launch_dir(0))
            assert not fs.exists(fs.location(final)) and not fs.exists(job.staging)
            with output_job(final) as job:
                fs.write_bytes(job.staging.child(launch_dir(0), "model.pt"), b"lost launch")
                for name in ("metrics.jsonl", "model.pt"):
                    fs.write_bytes(job.staging.child(launch_dir(1), name), name.encode())
                _keep_rank0_files(job, launch_dir(1))
            files = sorted(posixpath.relpath(f.path, fs.location(final).path) for f in fs.list_files(fs.location(final)))
            assert files == [outputs.COMPLETE_MARKER, "metrics.jsonl", "model.pt"]
            assert fs.read_bytes(fs.location(final).child("model.pt")) == b"model.pt"
            assert not fs.exists(job.staging)
