"""The straggler simulator: seeded per-worker slowdowns and random delays around the compute step."""
from __future__ import annotations

import time

import numpy as np
import pytest
from pydantic import ValidationError

from pipeline.train.stragglers import StragglerConfig, StragglerSimulator, delay_schedule


def test_inactive_by_default_sleeps_nothing():
    slept = []
    sim = StragglerSimulator(None, rank=0, sleep=slept.append)
    for _ in range(20):
        with sim.compute():
            pass
    assert slept == [] and sim.injected_s == 0 and not StragglerConfig().active


def test_slowdown_factor_multiplies_measured_compute_time():
    clock = iter([0.0, 0.010, 1.0, 1.030]).__next__  # two steps of 10 ms and 30 ms
    slept = []
    cfg = StragglerConfig(slowdown={1: 2.0})
    sim = StragglerSimulator(cfg, rank=1, sleep=slept.append, clock=clock)
    for _ in range(2):
        with sim.compute():
            pass
    assert slept == pytest.approx([0.010, 0.030])
    other = StragglerSimulator(cfg, rank=0, sleep=slept.append)
    assert not other.active  # only worker 1 is slowed down


def test_real_sleep_makes_the_worker_slower():
    cfg = StragglerConfig(slowdown={0: 2.0})
    sim = StragglerSimulator(cfg, rank=0)
    t0 = time.perf_counter()
    for _ in range(5):
        with sim.compute():
            time.sleep(0.01)
    took = time.perf_counter() - t0
    assert took >= 0.095  # 5 x (10 ms + >= 10 ms)
    assert sim.injected_s >= 0.045


def test_random_delays_seeded_per_worker_and_reproducible():
    cfg = StragglerConfig(delay_s=0.05, delay_prob=0.1, seed=3)
    a0 = delay_schedule(cfg, 0, 5000)
    assert np.array_equal(a0, delay_schedule(cfg, 0, 5000))  # reproducible
    a1 = delay_schedule(cfg, 1, 5000)
    assert not np.array_equal(a0, a1)  # workers differ
    assert not np.array_equal(a0, delay_schedule(cfg.model_copy(update={"seed": 4}), 0, 5000))
    for a in (a0, a1):
        assert 0.08 < a.mean() < 0.12  # probability 0.1


def test_delay_amount_and_stats():
    slept = []
    clock = iter([float(i) * 0.0 for i in range(2000)]).__next__
    cfg = StragglerConfig(delay_s=0.05, delay_prob=0.5, seed=0)
    sim = StragglerSimulator(cfg, rank=2, sleep=slept.append, clock=clock)
    for _ in range(100):
        with sim.compute():
            pass
    assert all(s == pytest.approx(0.05) for s in slept)
    assert len(slept) == sim.delayed_steps == int(delay_schedule(cfg, 2, 100).sum())
    assert sim.stats()["straggler_injected_s"] == pytest.approx(0.05 * len(slept))


@pytest.mark.parametrize("bad", [{"slowdown": {0: 0.5}}, {"slowdown": {-1: 2.0}}, {"delay_prob": 1.5},
                                 {"delay_s": -1}, {"nope": 1}])
def test_bad_values_rejected(bad):
    with pytest.raises(ValidationError):
        StragglerConfig(**bad)


def test_config_from_yaml_style_keys():
    cfg = StragglerConfig.model_validate({"slowdown": {"3": 2}, "delay_s": 0.05, "delay_prob": 0.1})
    assert cfg.slowdown == {3: 2.0} and cfg.active
