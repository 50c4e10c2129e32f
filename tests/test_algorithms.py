"""Numerical correctness of the synchronous algorithms on real communicators.

AR-SGD, local SGD and SlowMo on 2-process Horovod-on-Spark and TorchDistributor runs (shared
session fixtures); hierarchical local SGD on 4 torch.distributed processes started by
TorchDistributor (local mode: 4 processes on a 2-slot local Spark).
"""
from __future__ import annotations

import pytest

from pipeline.errors import ConfigError
from pipeline.train.algorithms import validate_params
from pipeline.train.config import TrainConfig
from pipeline.train.lr_schedule import lr_at, lr_factor

pytest_plugins = ["train_fixtures"]


@pytest.fixture(params=[pytest.param("horovod", marks=pytest.mark.needs_horovod), "torch"])
def ranks(request):
    return request.getfixturevalue(f"{request.param}_checks")


@pytest.mark.cluster
def test_arsgd_equals_single_process_large_batch(ranks):
    for r in ranks:
        assert r["arsgd"]["moved"] > 1e-2  # the run did something
        assert r["arsgd"]["max_diff"] < 1e-5


@pytest.mark.cluster
def test_local_sgd_h1_is_averaging_every_step_and_ranks_agree_after_averages(ranks):
    for r in ranks:
        ls = r["local_sgd"]
        assert ls["h1_max_diff"] < 1e-5
        assert ls["h3_averaged_at"] == [3, 6]
        eq = {int(k): v for k, v in ls["h3_equal_after_step"].items()}
        assert eq == {1: False, 2: False, 3: True, 4: False, 5: False, 6: True}


@pytest.mark.cluster
def test_slowmo_reduces_to_base_and_to_momentum_sgd(ranks):
    for r in ranks:
        s = r["slowmo"]
        assert s["beta0_max_diff"] < 1e-5
        assert s["lr1_max_diff"] < 1e-5
        assert s["no_average_distinct"]


@pytest.fixture(scope="module")
def hier(spark):
    from pipeline.train.selfcheck import launch_checks

    return launch_checks("torch", 4, ["hierarchical"], spark, torch_local_mode=True)


def _expected_level(n, periods):
    lh, ln, lw = periods
    return "world" if n % lw == 0 else "neighbourhood" if n % ln == 0 else "household" if n % lh == 0 else None


@pytest.mark.cluster
def test_hierarchical_touches_exactly_the_groups_the_periods_say(hier):
    assert len(hier) == 4
    for r in hier:
        rank = r["rank"]
        h = r["hierarchical"]
        periods = tuple(h["periods"])
        for name in ("singles_pairs", "pairs_world"):
            hs, ns = h[name]["sizes"]
            groups = {"household": tuple(range(rank - rank % hs, rank - rank % hs + hs)),
                      "neighbourhood": tuple(range(rank - rank % ns, rank - rank % ns + ns)),
                      "world": (0, 1, 2, 3)}
            for s in h[name]["steps"]:
                level = _expected_level(s["step"], periods)
                want = [] if level is None else [groups[level]]
                assert [tuple(g) for g in s["groups"]] == want, (name, rank, s)
                # observable effect: exactly the ranks of the averaged group hold our parameters
                together = list(groups[level]) if level else [rank]
                assert s["equal_to"] == together, (name, rank, s)
            levels = [lvl for _, lvl, _ in h[name]["history"]]
            assert levels == [lvl for lvl in (_expected_level(n, periods) for n in range(1, 13)) if lvl]


def test_algorithm_registry_validates_params():
    assert validate_params("local_sgd", {"period": 3}).period == 3
    with pytest.raises(ConfigError, match="algorithm.params.period=0"):
        validate_params("local_sgd", {"period": 0})
    with pytest.raises(ConfigError, match="unknown config key algorithm.params.H"):
        validate_params("local_sgd", {"H": 2})
    with pytest.raises(ConfigError, match="algorithm.name='nope'"):
        TrainConfig(algorithm={"name": "nope"})
    with pytest.raises(ConfigError, match="L_H < L_N < L_W"):
        validate_params("hierarchical", {"household_period": 4, "neighbourhood_period": 4, "world_period": 8})
    s = validate_params("slowmo", {"base": "post_local_sgd", "base_params": {"switch_step": 5}, "tau": 4})
    assert s.tau == 4
    with pytest.raises(ConfigError):
        validate_params("slowmo", {"base": "local_sgd", "base_params": {"period": -1}})


def test_linear_scaling_and_gradual_warmup():
    assert lr_at(0, 0.1, lr_factor("linear", 4), 0) == pytest.approx(0.4)
    assert lr_at(0, 0.1, lr_factor("none", 4), 10) == pytest.approx(0.1)
    ramp = [lr_at(s, 0.1, lr_factor("linear", 4), 4) for s in range(6)]
    assert ramp == pytest.approx([0.175, 0.25, 0.325, 0.4, 0.4, 0.4])
