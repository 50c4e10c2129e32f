"""The ``inprocess`` launcher: the M workers as ranks on threads of one process
(pipeline/train/comm/inprocess.py). The same seed gives the same run as the local launcher's M
processes joined by torch.distributed (gloo): the same steps and samples, and the same parameters
bit for bit at every evaluation; an asynchronous algorithm is refused; a failing rank ends the run
with its own error instead of a hang."""
from __future__ import annotations

import threading

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.train.comm.inprocess import InProcessCommunicator, InProcessWorld, PeerFailed
from pipeline.train.config import TrainConfig
from pipeline.train.launch import train
from train_fixtures import write_digit_shards


def _ranks(world: int, body) -> list:
    """``body(comm)`` on ``world`` threads, each a rank; the results in rank order."""
    meeting = InProcessWorld(world, timeout_s=30)
    out, errs = [None] * world, []

    def run(r):
        try:
            out[r] = body(InProcessCommunicator(meeting, r))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
            meeting.abort()

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errs:
        raise errs[0]
    return out


def test_the_collectives_compute_what_their_definitions_say():
    def body(c):
        r = c.rank
        a = torch.tensor([float(r), 10.0 * r])
        c.allreduce_mean_([a])
        g = c.new_group([0, 2])
        b = torch.tensor([float(r)])
        if r in (0, 2):
            c.allreduce_mean_([b], g)
        x = torch.tensor([float(r + 1)])
        c.broadcast_([x], root=2)
        got = c.exchange([torch.tensor([float(r)])], r ^ 1)
        parts = c.allgather_(torch.arange(r + 1, dtype=torch.float32))
        return a.tolist(), b.item(), x.item(), got[0].item(), [p.tolist() for p in parts], c.stats.bytes_sent

    res = _ranks(4, body)
    for r, (a, b, x, got, parts, sent) in enumerate(res):
        assert a == [1.5, 15.0]                              # (0 + 1 + 2 + 3) / 4, 10 x the same
        assert b == (1.0 if r in (0, 2) else float(r))       # the group {0, 2} only
        assert x == 3.0 and got == float(r ^ 1)
        assert parts == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0]]
    # bytes as torch.distributed counts them: allreduce 8, group 4 (members), broadcast 4 (root), exchange 4,
    # allgather its own tensor
    assert [s for *_, s in res] == [8 + 4 + 0 + 4 + 4, 8 + 0 + 0 + 4 + 8, 8 + 4 + 4 + 4 + 12, 8 + 0 + 0 + 4 + 16]


def test_a_failing_rank_stops_the_others_at_their_next_collective():
    def body(c):
        if c.rank == 1:
            raise ValueError("rank 1 broke")
        c.barrier()

    with pytest.raises((ValueError, PeerFailed)):
        _ranks(3, body)


@pytest.fixture(scope="module")
def digits2(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("digits2"), workers=2, n_train=512, n_test=128, n_val=64)


def _cfg(manifest, out, launcher: str, algorithm: dict) -> TrainConfig:
    return TrainConfig(manifest=str(manifest), output=str(out), launcher=launcher, model="lenet5", epochs=1,
                       batch_size=32, optimizer="sgd", lr=0.05, momentum=0.9, eval_every=4, progress=False,
                       algorithm=algorithm)


SYNCHRONOUS = [{"name": "arsgd"}, {"name": "local_sgd", "params": {"period": 3}},
               {"name": "post_local_sgd", "params": {"period": 2, "switch_step": 5}}, {"name": "dpsgd"},
               {"name": "swarm", "params": {"local_steps": 2, "topology": "ring"}}, {"name": "easgd"},
               {"name": "slowmo", "params": {"base": "local_sgd", "base_params": {"period": 2}}}]


# slow (about 8 s an algorithm): each also runs on the local launcher, 2 processes that import torch
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", SYNCHRONOUS, ids=[a["name"] for a in SYNCHRONOUS])
def test_the_same_seed_gives_the_local_launchers_run_bit_for_bit(digits2, tmp_path, algorithm):
    ref = train(_cfg(digits2, tmp_path / "local", "local", algorithm))
    got = train(_cfg(digits2, tmp_path / "inprocess", "inprocess", algorithm))
    assert got["steps"] == ref["steps"] and got["samples_processed"] == ref["samples_processed"]
    assert [r["digests"] for r in got["ranks"]] == [r["digests"] for r in ref["ranks"]]
    assert got["final_digests"] == ref["final_digests"]
    assert got["test_accuracy"] == ref["test_accuracy"] and got["test_loss"] == pytest.approx(ref["test_loss"])


def test_an_asynchronous_algorithm_or_augmentation_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="launcher='inprocess' for algorithm 'adpsgd'"):
        _cfg("m.json", tmp_path / "o", "inprocess", {"name": "adpsgd"})
    with pytest.raises(ConfigError, match="augment='crop_flip' with launcher='inprocess'"):
        TrainConfig(manifest="m.json", output=str(tmp_path / "o"), launcher="inprocess", augment="crop_flip")
