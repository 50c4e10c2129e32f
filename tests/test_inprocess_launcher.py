"""The ``inprocess`` launcher: the M workers as ranks on threads of one process
(pipeline/train/comm/inprocess.py). The same seed gives the same run as the local launcher's M
processes joined by torch.distributed (gloo): the same steps and samples, and the same parameters
bit for bit after every step (within float rounding where gloo sums more than two ranks in another
order); augmentation is refused; a failing rank ends the run with its own error instead of a hang, a
rank blocked outside a collective ends it within its stall limit, and no thread of a run outlives it;
what would silently differ from a real run is refused (tensors that do not match, draws from the
global random generators) or kept apart (the rendezvous of another process group).
The asynchronous algorithms under the simulated clock: tests/test_inprocess_async.py."""
from __future__ import annotations

import random
import sys
import threading
import time

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.train.comm.inprocess import GlobalRandomUsed, InProcessCommunicator, InProcessWorld, PeerFailed
from pipeline.train.config import TrainConfig
from pipeline.train.launch import train
from pipeline.train.local_launchers import END_GRACE_S
from train_fixtures import write_digit_shards


def _ranks(world: int, body, timeout_s: float = 30, device: str = "cpu") -> list:
    """``body(comm)`` on ``world`` threads, each a rank; the results in rank order. Every thread must
    have ended within 60 s (a failing rank must not leave another blocked)."""
    meeting = InProcessWorld(world, timeout_s=timeout_s)
    out, errs = [None] * world, []

    def run(r):
        try:
            out[r] = body(InProcessCommunicator(meeting, r, device))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
            meeting.abort()

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not [t.name for t in ts if t.is_alive()], "a rank thread did not end within 60 s"
    if errs:
        raise errs[0]
    return out


def _bounded(fn, limit_s: float):
    """``fn()`` on a thread of its own: (its result or exception, wall seconds, the threads it left
    running). Fails the test when ``fn`` did not return within ``limit_s``."""
    before = set(threading.enumerate())
    box: list = []

    def call():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - returned to the test
            box.append(e)

    caller = threading.Thread(target=call, daemon=True)
    t0 = time.monotonic()
    caller.start()
    caller.join(limit_s)
    secs = time.monotonic() - t0
    assert not caller.is_alive(), f"the run did not end within {limit_s} s"
    left = [t.name for t in threading.enumerate() if t not in before and t is not caller and t.is_alive()]
    return box[0], secs, left


@pytest.mark.parametrize("world", [3, 16])
def test_the_ranks_share_the_per_class_auc_and_every_rank_gets_sklearns_values(world):
    """Each rank computes the AUC of every world-th class only (metrics.summarize); all ranks end with
    every class's AUC as sklearn computes it on the whole split, in class order (16 ranks, 4 classes:
    ranks without a class of their own)."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    from pipeline.train.metrics import summarize

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 500)
    probs = rng.dirichlet(np.ones(4), 500).astype(np.float32)
    probs[np.arange(500), labels] += 0.3 * rng.random(500).astype(np.float32)
    want = {str(c): float(roc_auc_score(labels == c, probs[:, c])) for c in range(4)}
    for res in _ranks(world, lambda c: summarize(probs, labels, 123.0, c)):
        assert list(res["auc"]) == ["0", "1", "2", "3"] and res["auc"] == want
        assert res["n"] == 500 and res["loss"] == 123.0 / 500
    assert summarize(probs, labels, 123.0)["auc"] == want


def test_a_diverged_model_is_scored_not_crashed():
    """A run whose weights went to NaN (a rate too high for its batch, as a tuning grid finds) is
    evaluated, not failed: no AUC for a class whose scores are not finite, the loss NaN, and the
    accuracy as the predictions give it, so the study records the run as collapsed."""
    import math

    import numpy as np

    from pipeline.train.metrics import summarize

    labels = np.array([0, 1, 2, 0, 1, 2])
    probs = np.full((6, 3), np.nan, dtype=np.float32)
    res = summarize(probs, labels, float("nan"))
    assert res["auc"] == {"0": None, "1": None, "2": None}
    assert math.isnan(res["loss"]) and res["n"] == 6 and 0.0 <= res["accuracy"] <= 1.0
    probs[:, :] = 1 / 3
    probs[0, 1] = np.inf            # one non-finite score spoils that class's AUC only
    res = summarize(probs, labels, 1.0)
    assert res["auc"]["1"] is None and res["auc"]["0"] == 0.5 and res["auc"]["2"] == 0.5


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


def test_tensors_that_do_not_match_fail_the_collective_on_every_rank():
    """gloo refuses an allreduce or broadcast whose ranks pass other shapes; summing them in memory
    would broadcast (0 + [1, 1] -> a mean of two elements) or copy into another shape on one rank only."""
    def body(c):
        got = []
        for op in ("allreduce", "broadcast"):
            t = torch.ones(2 if c.rank == 0 else 1)
            try:
                c.allreduce_mean_([t]) if op == "allreduce" else c.broadcast_([t], root=1)
                got.append("completed")
            except ValueError as e:
                got.append(str(e))
        return got

    res = _ranks(2, body)
    assert "tensor 0 is (1,) float32 on rank 1 but (2,) float32 on rank 0" in res[0][0]
    assert res[0][0] == res[1][0]
    assert res[1][1] == "completed"                      # the root of the broadcast
    assert "tensor 0 is (2,) float32 on rank 0 but (1,) float32 on rank 1" in res[0][1]


def test_the_rendezvous_of_another_process_group_is_another_one():
    """A CUDA world's host view is a gloo group of its own under torch.distributed: a barrier on it and
    one on the world never meet (there: a timeout), even though both hold ranks 0 and 1."""
    def body(c):
        try:
            (c.host() if c.rank == 0 else c).barrier()
            return "met"
        except PeerFailed as e:
            return str(e)

    res = _ranks(2, body, timeout_s=0.5, device="meta")
    assert all("did not arrive within 0.5 s" in r for r in res), res


@pytest.mark.parametrize("draw", ["torch", "numpy", "random"])
def test_a_rank_that_draws_from_the_global_generators_is_refused(draw):
    """The ranks share the process's generators: dropout or a randperm without a generator of its own on
    one rank would move every rank's stream. A beat after such a draw fails in one line."""
    def body(c):
        dog = c.stall_watch()
        dog.beat()                          # the state after the model's build
        c.barrier()
        if c.rank == 1:
            {"torch": lambda: torch.nn.functional.dropout(torch.ones(4), 0.5), "numpy": np.random.rand,
             "random": random.random}[draw]()
        c.barrier()
        dog.beat()

    with pytest.raises(GlobalRandomUsed, match=r"^rank \d: the process's global random generators .* use launcher "
                                               r"local$"):
        _ranks(2, body)


@pytest.fixture(scope="module")
def digits2(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("digits2"), workers=2, n_train=512, n_test=128, n_val=64)


def _cfg(manifest, out, launcher: str, algorithm: dict, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(manifest=str(manifest), output=str(out), launcher=launcher, model="lenet5", epochs=1,
                                 batch_size=32, optimizer="sgd", lr=0.05, momentum=0.9, eval_every=4, progress=False,
                                 algorithm=algorithm, debug={"record_param_digests": True}), **kw})


@pytest.mark.parametrize("algorithm", [{"name": "arsgd"}, {"name": "adpsgd", "params": {"round_steps": 4}}],
                         ids=["free_threads", "simulated_clock"])
def test_a_rank_blocked_outside_a_collective_ends_the_run_within_its_stall_limit(digits2, tmp_path, algorithm):
    """Rank 1 blocks for good after its second step (``fail_mode=hang``, what a data-loader deadlock looks
    like): the run ends with one line naming it, about stall_timeout after its last beat, and none of the
    run's threads (the other rank, the simulated clock's threads) is left running."""
    cfg = _cfg(digits2, tmp_path / "o", "inprocess", algorithm, stall_timeout=2, max_restarts=0, max_steps=6,
               debug={"fail_at_step": 2, "fail_rank": 1, "fail_mode": "hang"})
    err, secs, left = _bounded(lambda: train(cfg), 60)
    assert isinstance(err, Exception), err
    msg = str(err)
    assert "\n" not in msg and "rank 1: stalled: no step, evaluation or checkpoint completed for 2 s " \
                               "(stall_timeout=2); the in-process run was ended" in msg, msg
    assert "could not be stopped" not in msg
    assert secs < 2 + 2 * END_GRACE_S + 10, secs      # the stall limit, the interrupt's grace, the run's start
    assert not left, left


SYNCHRONOUS = [{"name": "arsgd"}, {"name": "local_sgd", "params": {"period": 3}},
               {"name": "post_local_sgd", "params": {"period": 2, "switch_step": 5}}, {"name": "dpsgd"},
               {"name": "swarm", "params": {"local_steps": 2, "topology": "ring"}}, {"name": "easgd"},
               {"name": "slowmo", "params": {"base": "local_sgd", "base_params": {"period": 2}}}]


def test_a_failing_rank_ends_a_free_thread_run_with_its_own_error_and_no_thread_left(digits2, tmp_path):
    cfg = _cfg(digits2, tmp_path / "o", "inprocess", {"name": "local_sgd", "params": {"period": 2}}, max_restarts=0,
               max_steps=6, debug={"fail_at_step": 3, "fail_rank": 0})
    err, secs, left = _bounded(lambda: train(cfg), 60)
    assert "fail_at_step=3 reached (simulated crash)" in str(err) and "PeerFailed" not in str(err), err
    assert not left, left                  # rank 1, blocked in its next average or not: ended


def test_a_rank_blocked_inside_a_c_call_fails_the_run_and_no_later_run_overlaps_it(digits2, tmp_path,
                                                                                     monkeypatch):
    """A rank blocked in one C call (an Event's wait: what a deadlocked loader's queue does) cannot be
    interrupted: the stalled run fails in one line naming its thread, and the process refuses the next
    in-process run while that thread lives instead of running beside it."""
    import pipeline.train.local_launchers as launchers
    import pipeline.train.restart as restart

    gate = threading.Event()

    def blocks_in_c(debug, rank, step):
        if rank == 1 and step == 2:
            gate.wait()

    monkeypatch.setattr(restart, "inject_fault", blocks_in_c)
    monkeypatch.setattr(launchers, "END_GRACE_S", 0.5)
    cfg = _cfg(digits2, tmp_path / "o", "inprocess", {"name": "arsgd"}, stall_timeout=2, max_steps=6)
    try:
        err, secs, _ = _bounded(lambda: train(cfg), 60)
        assert "rank 1: stalled: no step, evaluation or checkpoint completed for 2 s" in str(err), err
        assert "its thread(s) rank-1 could not be stopped (blocked inside a C call)" in str(err), err
        with pytest.raises(Exception, match=r"thread\(s\) rank-1 of an earlier in-process run of this process still "
                                            r"run"):
            train(cfg.model_copy(update={"output": str(tmp_path / "next")}))
    finally:
        gate.set()                     # the blocked call returns; the interrupt ends the thread
    time.sleep(0.5)
    assert not [t for t in threading.enumerate() if t.name == "rank-1"]


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


def test_augmentation_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="augment='crop_flip' with launcher='inprocess'"):
        TrainConfig(manifest="m.json", output=str(tmp_path / "o"), launcher="inprocess", augment="crop_flip")


def write_household_shards(out, workers: int = 4, households: int = 2, household_shards: int = 1,
                           neighbourhoods: int | None = None, n_train: int = 512, n_test: int = 128,
                           n_val: int = 64, row_group_rows: int = 64):
    """A households (or neighbourhoods) layout of the real digits: the assignment, shuffle seeds and
    household / neighbourhood groups come from the shard stage's pure scheme
    (``pipeline.shards.schemes.assign``), the rows and the manifest from the test writer's own helpers."""
    import numpy as np

    from pipeline.shards.schemes import assign, resolve_layout
    from train_fixtures import mnist_digits, write_layout

    _, y = mnist_digits()
    perm = np.random.default_rng(0).permutation(len(y))
    train_ids = np.sort(perm[:n_train])
    test, val = perm[n_train:n_train + n_test], perm[n_train + n_test:n_train + n_test + n_val]
    scheme = "neighbourhoods" if neighbourhoods else "households"
    layout = resolve_layout(scheme, workers, households=households, household_shards=household_shards,
                            neighbourhoods=neighbourhoods, seed=0)
    a = assign(layout, n_train)
    return write_layout(out, [train_ids[a.members[w]] for w in range(workers)],   # each worker's write order
                        seeds=list(a.seeds), groups=list(a.groups), test=test, val=val, layout=layout.to_manifest(),
                        n_train=n_train, row_group_rows=row_group_rows)


@pytest.fixture(scope="module")
def households4(tmp_path_factory):
    """4 workers in 2 households of 2, one household shard (C = 2): E3.2.4's scheme (``households``: one
    neighbourhood, the world) and the same with 2 neighbourhoods of one household (``neighbourhoods``)."""
    root = tmp_path_factory.mktemp("households4")
    return {"households": write_household_shards(root / "h", workers=4, households=2, household_shards=1,
                                                 n_train=384),
            "neighbourhoods": write_household_shards(root / "n", workers=4, households=2, household_shards=1,
                                                     neighbourhoods=2, n_train=384)}


@pytest.fixture(scope="module")
def digits4(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("digits4"), workers=4, n_train=512, n_test=128, n_val=64)


def _cfg4(manifest, out, launcher: str, algorithm: dict, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(manifest=str(manifest), output=str(out), launcher=launcher, model="lenet5", epochs=1,
                                 batch_size=16, optimizer="sgd", lr=0.05, momentum=0.9, eval_every=3, max_steps=6,
                                 progress=False, algorithm=algorithm, debug={"record_param_digests": True}), **kw})


def _same_run(got: dict, ref: dict) -> None:
    """Every step's parameters equal bit for bit; the final model, the world average of 4 ranks (which gloo
    sums in another order than rank order), within float rounding."""
    assert got["steps"] == ref["steps"] and got["samples_processed"] == ref["samples_processed"]
    assert [r["digests"] for r in got["ranks"]] == [r["digests"] for r in ref["ranks"]]
    mine, theirs = _final_model(got), _final_model(ref)
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6)
    assert abs(got["test_accuracy"] - ref["test_accuracy"]) <= 1 / 128


def _final_model(summary: dict) -> dict:
    return torch.load(summary["model_path"], weights_only=True)["model"]


HIERARCHICAL = {"name": "hierarchical", "params": {"household_period": 1, "neighbourhood_period": 2,
                                                   "world_period": 4}}


# slow (about 21 s each): the reference is the local launcher's 4 processes, each importing torch, on 2 cores
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["households", "neighbourhoods"])
def test_hierarchical_on_households_matches_the_local_launchers_run(households4, tmp_path, scheme):
    """Households (and neighbourhoods) from the manifest's groups, E3.2.4's batch rule (Eq. A.3) and rate
    scaling: the same batches, rates and groups on both launchers, household averages at step 1 and 3,
    neighbourhood at 2, world at 4. An average over 2 ranks has one order of the sum: the parameters are
    equal bit for bit until the first average of 4 ranks (``households``: the neighbourhood is the world,
    step 2; ``neighbourhoods``: step 4). gloo sums 4 ranks in another order than rank order, so from there
    on they agree within float rounding."""
    kw = {"batch_rule": "household", "lr_scaling": "household", "batch_size": 32}
    ref = train(_cfg4(households4[scheme], tmp_path / "local", "local", HIERARCHICAL, **kw))
    got = train(_cfg4(households4[scheme], tmp_path / "inprocess", "inprocess", HIERARCHICAL, **kw))
    assert got["steps"] == ref["steps"] == 6 and got["samples_processed"] == ref["samples_processed"]
    d, dref = [r["digests"] for r in got["ranks"]], [r["digests"] for r in ref["ranks"]]
    exact = 1 if scheme == "households" else 3
    assert [r[:exact] for r in d] == [r[:exact] for r in dref]
    assert d[0][0] == d[1][0] != d[2][0] == d[3][0]      # step 1: household averages only ({0, 1}, {2, 3})
    if scheme == "households":
        assert len({r[1] for r in d}) == 1               # step 2: the neighbourhood is the world
    else:
        assert d[0][1] == d[1][1] != d[2][1] == d[3][1]  # step 2: each neighbourhood is one household
    assert len({r[3] for r in d}) == 1                   # step 4: the world average
    mine, theirs = _final_model(got), _final_model(ref)
    assert mine.keys() == theirs.keys()
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6)
    assert abs(got["test_accuracy"] - ref["test_accuracy"]) <= 1 / 128   # at most one of the 128 test digits


SWARM_STEP_SCHEDULES = [{"name": "swarm", "params": {"local_steps": 2, "schedule": "geometric"}},
                        {"name": "swarm", "params": {"local_steps": 1, "topology": "regular", "degree": 2,
                                                     "weighting": "steps"}}]


# slow (about 40 s each): the local launcher's 4 processes, each importing torch, are the reference
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", SWARM_STEP_SCHEDULES, ids=["geometric", "regular_steps_weighting"])
def test_swarm_with_step_schedules_gives_the_local_launchers_run_bit_for_bit(digits4, tmp_path, algorithm):
    """SwarmSGD on 4 workers with its step schedules (geometric H per worker and round: the round-driven
    driver; fixed H on a 2-regular graph, averaging weighted by steps): the same partners, local step
    counts and parameters after every step (pairwise averages: one order of the sum)."""
    ref = train(_cfg4(digits4, tmp_path / "local", "local", algorithm))
    got = train(_cfg4(digits4, tmp_path / "inprocess", "inprocess", algorithm))
    _same_run(got, ref)
    assert [r["steps"] for r in got["ranks"]] == [r["steps"] for r in ref["ranks"]]


def test_the_gpu_check_without_cuda_says_so_in_one_line_and_runs_nothing(tmp_path):
    """scripts/gpu_inprocess_check.sh on a host without CUDA (CUDA_VISIBLE_DEVICES="" hides any GPU)."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(["bash", str(repo / "scripts" / "gpu_inprocess_check.sh"), "--workdir", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable})
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 1
    assert len(lines) == 1 and lines[0].startswith("gpu-inprocess-check: no CUDA device"), lines
    assert not (tmp_path / "w").exists()
