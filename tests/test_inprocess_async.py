"""The ``inprocess`` launcher's simulated clock (pipeline/train/comm/simclock.py): the asynchronous
algorithms (AD-PSGD, EA-wild, the asynchronous parameter server), time-budgeted local SGD and the
straggler models run their unchanged code on ranks of one process, one thread at a time, in an order
decided by virtual time and the seed only.

* the same seed gives the same run to the bit (parameter digests after every step, the order the
  threads ran in, the staleness histograms), run after run;
* another seed of the clock, or another straggler factor, gives another interleaving;
* virtual compute time decides the steps of a time-budgeted round exactly (a worker 3x slower takes the
  steps that fit its budget);
* a synchronous algorithm gives the same digests with and without the simulated clock;
* a failing rank ends the run with its own error, a deadlock fails instead of hanging, and no thread
  of the run outlives it (also when ``Simulation.run`` times out);
* the launcher's limits are wall-clock stall limits: virtual seconds count toward nothing;
* the staleness of a simulated run is in the regime of a real local-launcher run (slow: the reference
  starts 2 processes).
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from pipeline.train.comm.simclock import event, sleep, thread
from pipeline.train.comm.simcore import SimDeadlock, Simulation
from pipeline.train.config import TrainConfig
from pipeline.train.launch import train
from pipeline.train.stragglers import SimClockConfig
from train_fixtures import write_digit_shards


@pytest.fixture(scope="module")
def digits2(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("digits2"), workers=2, n_train=512, n_test=128, n_val=64)


@pytest.fixture(scope="module")
def digits4(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("digits4"), workers=4, n_train=512, n_test=128, n_val=64)


def _cfg(manifest, out, algorithm: dict, launcher: str = "inprocess", **kw) -> TrainConfig:
    base = dict(manifest=str(manifest), output=str(out), launcher=launcher, model="lenet5", epochs=2, batch_size=32,
                optimizer="sgd", lr=0.05, momentum=0.9, eval_every=8, progress=False, algorithm=algorithm,
                debug={"record_param_digests": True})
    return TrainConfig(**{**base, **kw})


def _records(summary: dict) -> list[dict]:
    with open(summary["metrics"]) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run(tmp_path, name: str, cfg: TrainConfig) -> dict:
    return train(cfg.model_copy(update={"output": str(tmp_path / name)}))


def _fingerprint(s: dict) -> tuple:
    """Everything the interleaving decides: every rank's digests after every step, the final ones, the
    threads' order, the staleness histograms and step counts of every record."""
    recs = [(r.get("staleness_hist"), r.get("global_steps"), r["accuracy"]) for r in _records(s)]
    return ([r["digests"] for r in s["ranks"]], s["final_digests"], s["ranks"][0]["simulated_clock"], recs,
            [r["steps"] for r in s["ranks"]])


CASES = {
    "adpsgd_4": ({"name": "adpsgd", "params": {"round_steps": 4}}, 4, {}),
    "eawild": ({"name": "eawild", "params": {"round_steps": 4}}, 2, {}),
    "eawild_groups_time_rounds": ({"name": "eawild", "params": {"round_steps": 2, "round_seconds": 0.03,
                                                                 "group_size": 2}}, 4, {}),
    "easgd_locked_delays": ({"name": "eawild", "params": {"round_steps": 4, "lock": True}}, 2,
                            {"stragglers": {"delay_s": 0.02, "delay_prob": 0.3}}),
    "async_ps_straggler": ({"name": "async_ps", "params": {"round_steps": 4}}, 2, {"stragglers": {"slowdown": {1: 2.0}}}),
    "timed_local_sgd": ({"name": "timed_local_sgd", "params": {"round_seconds": 0.05}}, 2, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_seed_gives_the_same_run_to_the_bit(digits2, digits4, tmp_path, case):
    algorithm, workers, kw = CASES[case]
    cfg = _cfg(digits2 if workers == 2 else digits4, tmp_path, algorithm, **kw)
    a, b = _run(tmp_path, "a", cfg), _run(tmp_path, "b", cfg)
    assert _fingerprint(a) == _fingerprint(b)
    assert a["test_accuracy"] == b["test_accuracy"] and a["test_loss"] == b["test_loss"]
    assert a["ranks"][0]["simulated_clock"]["virtual_s"] > 0
    digests = a["ranks"][0]["digests"]
    assert len(set(digests)) == len(digests)                 # the parameters moved at every step
    if algorithm["name"] != "timed_local_sgd":
        recs = _records(a)
        assert all(r["staleness_mean"] is not None for r in recs if r["split"] == "val")


def test_another_seed_or_straggler_factor_gives_another_interleaving(digits4, tmp_path):
    """The model's seed fixed: the clock's seed (compute times, order of equal times), a straggler factor
    or the message delay alone changes the order of the averagings, and so the parameters."""
    cfg = _cfg(digits4, tmp_path, {"name": "adpsgd", "params": {"round_steps": 4}})
    ref = _fingerprint(_run(tmp_path, "ref", cfg))
    other_seed = _fingerprint(_run(tmp_path, "seed", cfg.model_copy(
        update={"simulated_clock": SimClockConfig(seed=cfg.seed + 1)})))
    slow = _fingerprint(_run(tmp_path, "slow", cfg.model_copy(
        update={"stragglers": cfg.stragglers.model_copy(update={"slowdown": {3: 2.0}})})))
    late = _fingerprint(_run(tmp_path, "late", cfg.model_copy(
        update={"simulated_clock": SimClockConfig(latency_s=0.02)})))      # messages slower than a step
    for other in (other_seed, slow, late):
        assert other[2]["trace"] != ref[2]["trace"]           # the threads ran in another order
        assert other[1] != ref[1]                             # and the averagings changed the parameters
        assert other[0][0][0] == ref[0][0][0]                 # the same first step (the seed of the model)


def test_virtual_compute_time_decides_the_steps_of_a_time_budgeted_round(digits2, tmp_path):
    """Time-budgeted local SGD, rounds of 0.095 virtual s, steps of exactly 0.01 s (no jitter): worker 0
    takes ceil(0.095 / 0.01) = 10 steps a round, worker 1 at 3x ceil(0.095 / 0.03) = 4, in every round."""
    cfg = _cfg(digits2, tmp_path, {"name": "timed_local_sgd", "params": {"round_seconds": 0.095, "nominal_steps": 8}},
               epochs=1, simulated_clock={"step_s": 0.01, "step_jitter": 0.0}, stragglers={"slowdown": {1: 3.0}})
    s = _run(tmp_path, "timed", cfg)
    rounds = s["rounds"]
    assert rounds == 1 and [r["steps"] for r in s["ranks"]] == [10 * rounds, 4 * rounds]
    cfg2 = cfg.model_copy(update={"max_steps": None, "epochs": 3})
    s2 = _run(tmp_path, "timed3", cfg2)
    assert s2["rounds"] == 3 and [r["steps"] for r in s2["ranks"]] == [30, 12]
    assert s2["ranks"][1]["straggler_injected_s"] == pytest.approx(12 * 0.02)


def test_eawild_groups_with_a_slow_member_take_fewer_steps_and_the_other_group_does_not_wait(digits4, tmp_path):
    """EA-wild on 4 workers in groups of 2, time-budgeted rounds, worker 3 at 3x: each group's members
    take the same steps; the group with the slow member takes fewer, and the other group as many as
    with no slow member at all (it never waits for the slow group). Under the simulated clock this holds
    to the step on any machine; real processes on a loaded host order it only by chance
    (tests/test_eawild.py checks the same run's exchanges there)."""
    algorithm = {"name": "eawild", "params": {"round_steps": 4, "round_seconds": 0.095, "group_size": 2}}
    clock = {"step_s": 0.01, "step_jitter": 0.0}
    even = _run(tmp_path, "even", _cfg(digits4, tmp_path, algorithm, epochs=1, simulated_clock=clock))
    slow = _run(tmp_path, "slow", _cfg(digits4, tmp_path, algorithm, epochs=1, simulated_clock=clock,
                                       stragglers={"slowdown": {3: 3.0}}))
    e, s = ([r["steps"] for r in run["ranks"]] for run in (even, slow))
    assert e[0] == e[1] == e[2] == e[3], e
    assert s[0] == s[1] and s[2] == s[3] and s[2] < s[0], s
    assert s[0] == e[0], (s, e)


def test_a_synchronous_algorithm_gives_the_same_digests_with_the_simulated_clock(digits2, tmp_path):
    cfg = _cfg(digits2, tmp_path, {"name": "swarm", "params": {"local_steps": 2, "schedule": "geometric"}})
    free = _run(tmp_path, "free", cfg)
    sim = _run(tmp_path, "sim", cfg.model_copy(update={"simulated_clock": SimClockConfig(always=True)}))
    assert "simulated_clock" not in free["ranks"][0] and sim["ranks"][0]["simulated_clock"]["switches"] > 0
    assert [r["digests"] for r in sim["ranks"]] == [r["digests"] for r in free["ranks"]]
    assert sim["final_digests"] == free["final_digests"]


def test_the_simulated_pair_channels_carry_tensors_only():
    """SimChannel keeps P2PChannel's contract: a non-tensor payload is refused in one line, a channel to a
    rank outside its pairs does not exist."""
    from pipeline.train.comm.p2p import PeerError, SimChannel

    ch = SimChannel(None, 0, 3, [(0, 1)])
    assert ch.peers == [1]
    with pytest.raises(TypeError, match="only tensors travel"):
        ch.send({"x": 1}, 1)
    with pytest.raises(PeerError, match="no channel to rank 2"):
        ch.send(torch.zeros(1), 2)


def test_a_failing_rank_ends_a_simulated_run_with_its_own_error(digits2, tmp_path):
    cfg = _cfg(digits2, tmp_path, {"name": "adpsgd", "params": {"round_steps": 4}}, max_restarts=0,
               debug={"fail_at_step": 3, "fail_rank": 1})
    before = set(threading.enumerate())
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"fail_at_step=3 reached \(simulated crash\)") as e:
        _run(tmp_path, "fail", cfg)
    assert time.monotonic() - t0 < 60
    assert "PeerFailed" not in str(e.value) and "deadlock" not in str(e.value)   # rank 1's error, not a consequence
    assert not (tmp_path / "fail").exists()
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, left                  # rank 0, both ranks' communication threads: all ended


def test_virtual_seconds_are_no_time_limit(digits2, tmp_path):
    """Local SGD with a 5x straggler at 5 virtual s a step: rank 0 waits 80 virtual s at the first average.
    The launcher's limits are wall-clock limits on stalls: with start_timeout 1 and the stall limit off
    (stall_timeout 0) the run completes, whatever its virtual length."""
    cfg = _cfg(digits2, tmp_path, {"name": "local_sgd", "params": {"period": 4}}, epochs=1, max_steps=4,
               start_timeout=1, stall_timeout=0, simulated_clock={"step_s": 5.0, "step_jitter": 0.0},
               stragglers={"slowdown": {1: 5.0}})
    s = _run(tmp_path, "slow", cfg)
    assert s["steps"] == 4 and s["ranks"][0]["simulated_clock"]["virtual_s"] >= 100


def test_a_simulated_run_that_times_out_leaves_no_thread_running():
    """``Simulation.run(timeout_s)`` on a thread that never ends: TimeoutError, and the thread has ended
    when it is raised (it would otherwise go on in a process that runs the next run)."""
    sim, steps = Simulation(SimClockConfig(), seed=0), []

    def forever() -> None:
        while True:
            sleep(1.0)
            steps.append(sim.now)

    sim.spawn(forever, (), "forever")
    with pytest.raises(TimeoutError, match="did not end within"):
        sim.run(0.5)
    assert not [t for t in threading.enumerate() if t.name == "forever"]
    n = len(steps)
    time.sleep(0.2)
    assert len(steps) == n > 0


def test_the_scheduler_runs_threads_in_virtual_time_and_fails_a_deadlock():
    """Sleeps end in virtual-time order whatever the real time; equal times in an order the seed decides;
    two threads waiting for each other fail with SimDeadlock instead of hanging."""
    def order(seed: int) -> list:
        sim, out = Simulation(SimClockConfig(), seed=seed), []

        def sleeper(name: str, s: float) -> None:
            sleep(s)
            out.append((name, sim.now))

        for name, s in [("late", 0.3), ("early", 0.1), ("tie-a", 0.2), ("tie-b", 0.2), ("tie-c", 0.2)]:
            sim.spawn(sleeper, (name, s), name)
        sim.run(30)
        return out

    runs = {seed: order(seed) for seed in range(6)}
    for out in runs.values():
        assert [t for _, t in out] == [0.1, 0.2, 0.2, 0.2, 0.3] and out[0][0] == "early" and out[-1][0] == "late"
    assert len({tuple(n for n, _ in out) for out in runs.values()}) > 1     # ties: the seed decides
    assert order(3) == runs[3]

    sim, errors = Simulation(SimClockConfig(), seed=0), []

    def waits_for(mine, other) -> None:
        try:
            other.wait()
        except SimDeadlock as e:
            errors.append(str(e))
        mine.set()

    def main() -> None:
        a, b = event(), event()
        ts = [thread(waits_for, (a, b), name="A"), thread(waits_for, (b, a), name="B")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    sim.spawn(main, (), "main")
    sim.run(30)
    assert len(errors) >= 1 and "deadlocked" in errors[0] and "an event" in errors[0]


def _staleness(summary: dict) -> tuple[list[int], float]:
    """The run's staleness histogram (every validation record's interval) and its mean."""
    total: list[int] = []
    for r in _records(summary):
        if r["split"] == "val":
            for i, v in enumerate(r["staleness_hist"]):
                total += [0] * (i + 1 - len(total))
                total[i] += v
    n = sum(total)
    return total, sum(i * v for i, v in enumerate(total)) / n


# slow (about 25 s): the reference runs start the local launcher's 2 processes, each importing torch
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [{"name": "eawild", "params": {"round_steps": 4}},
                                       {"name": "async_ps", "params": {"round_steps": 4}},
                                       {"name": "adpsgd", "params": {"round_steps": 4}}],
                         ids=["eawild", "async_ps", "adpsgd"])
def test_simulated_staleness_is_in_the_regime_of_a_real_run(digits2, tmp_path, algorithm):
    """AsyncStats of the same config on the local launcher (2 processes, gloo) and under the simulated
    clock: both histograms printed; the means within 0.75 of each other. EA-wild and the parameter server:
    pushes of the other worker between a pull and a push (about 1 when both keep pace); AD-PSGD: local
    steps during an averaging (about 0 when an averaging is faster than a step)."""
    cfg = _cfg(digits2, tmp_path, algorithm, epochs=4)
    real = _staleness(_run(tmp_path, "local", cfg.model_copy(update={"launcher": "local"})))
    sim = _staleness(_run(tmp_path, "sim", cfg))
    print(f"\n{algorithm['name']}: staleness local launcher {real[0]} mean {real[1]:.3f}; "
          f"simulated clock {sim[0]} mean {sim[1]:.3f}")
    if algorithm["name"] == "adpsgd":        # an active starts at most one averaging per step of its own
        assert 0 < sum(real[0]) <= sum(sim[0])
    else:                                    # one push per step (step-mode rounds): the same number
        assert sum(real[0]) == sum(sim[0])
    assert abs(real[1] - sim[1]) <= 0.75
