"""Checkpoints on an S3-compatible object store (a real moto server on loopback): a run deletes
only checkpoint objects (``step_NNNNNNNN/`` rank files and ``meta.json``), refuses with one line a
prefix that holds anything else before deleting anything, and keeps the checkpoint of a run
that did not finish unless told to resume it or to start over."""
from __future__ import annotations

import logging

import pytest
import torch

from pipeline import fs
from pipeline.errors import BadInputError, ConfigError
from pipeline.train import checkpoint, restart
from pipeline.train.comm import make_communicator
from pipeline.train.config import TrainConfig
from servers import environment, s3_server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server, environment(**server.env("writer")):
        yield server


@pytest.fixture
def comm():
    c = make_communicator("local")
    yield c
    c.shutdown()


class _Algo:
    def state_dict(self):
        return {"step_count": 3}


def _write(comm, ck: str, step: int, fp: dict) -> str:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return checkpoint.write(comm, ck, step, model, opt, _Algo(), {"elapsed_s": 1.0, "fingerprint": fp, "metrics": []})


def _objects(prefix: str) -> dict:
    loc = fs.location(prefix)
    return {f.path[len(loc.path) + 1:]: fs.read_bytes(f) for f in fs.list_files(loc)}


def _put(uri: str, data: bytes) -> None:
    fs.write_bytes(fs.location(uri), data)


def _cfg(tmp_path, **kw):
    return TrainConfig(manifest="m.json", output=str(tmp_path / "out"), **kw)


def test_a_shared_prefix_with_another_runs_objects_is_refused_and_nothing_deleted(s3, comm, tmp_path):
    ck = f"s3://{s3.bucket}/shared-ckpts"
    cfg = _cfg(tmp_path, fresh_start=True)
    fp = checkpoint.fingerprint(cfg, 1)
    _write(comm, f"{ck}/run-a", 5, fp)           # another run's checkpoints under its own prefix
    _put(f"{ck}/run-b.parquet", b"PAR1 data")    # and some data
    checkpoint.mark_finished(_write(comm, ck, 7, fp))
    before = _objects(ck)
    for resume in (False, True, "auto"):
        with pytest.raises(BadInputError) as e:
            restart.start_checkpoint(cfg.model_copy(update={"resume": resume, "fresh_start": resume is False}),
                                     checkpoint.location_of(ck), fp)
        msg = str(e.value)
        assert "\n" not in msg and ck in msg and "nothing was deleted" in msg and "run-a" in msg, msg
    assert _objects(ck) == before


def test_a_fresh_start_deletes_only_the_checkpoints_of_a_finished_run(s3, comm, tmp_path, caplog):
    ck = f"s3://{s3.bucket}/finished-ckpts"
    cfg = _cfg(tmp_path)
    fp = checkpoint.fingerprint(cfg, 1)
    for s in (4, 8):
        last = _write(comm, ck, s, fp)
    checkpoint.mark_finished(last)
    _put(f"{ck}/step_00000012/.rank_000.pt.tmp-77", b"cut short")  # a write cut short: ours too
    with caplog.at_level(logging.WARNING):
        assert restart.start_checkpoint(cfg, checkpoint.location_of(ck), fp) is None
    assert any("starting fresh" in r.getMessage() and "step_00000008" in r.getMessage() for r in caplog.records)
    assert _objects(ck) == {}
    assert checkpoint.candidates(ck) == []  # no empty directory markers left behind


def test_the_checkpoint_of_an_unfinished_run_is_kept_on_a_plain_rerun(s3, comm, tmp_path):
    ck = f"s3://{s3.bucket}/failed-ckpts"
    cfg = _cfg(tmp_path)
    fp = checkpoint.fingerprint(cfg, 1)
    _write(comm, ck, 5, fp)
    before = _objects(ck)
    with pytest.raises(ConfigError, match=r"step_00000005.*resume=true.*fresh_start=true"):
        restart.start_checkpoint(cfg, checkpoint.location_of(ck), fp)
    assert _objects(ck) == before
    assert restart.start_checkpoint(cfg.model_copy(update={"resume": "auto"}), checkpoint.location_of(ck),
                                    fp).name == "step_00000005"


def test_pruning_on_the_store_deletes_only_checkpoint_objects(s3, comm):
    ck = f"s3://{s3.bucket}/prune-ckpts"
    fp = {"seed": 0}
    for s in (2, 4, 6):
        _write(comm, ck, s, fp)
    _put(f"{ck}/step_00000002/notes.txt", b"a user's object")
    removed = checkpoint.prune(ck, 1)
    assert [p.name for p in removed] == ["step_00000004", "step_00000002"]
    left = _objects(ck)
    assert "step_00000002/notes.txt" in left and not any(k.startswith("step_00000004") for k in left)
    assert {k for k in left if k.startswith("step_00000006/")} == {"step_00000006/meta.json",
                                                                  "step_00000006/rank_000.pt"}
