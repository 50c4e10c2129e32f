"""Config validation and registry wiring of the decentralized algorithms (single process, no launcher)."""
from __future__ import annotations

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.train.algorithms import BuildContext, build_algorithm, validate_params
from pipeline.train.algorithms.averaging import ModelAverager
from pipeline.train.algorithms.decentral import LocalSteps
from pipeline.train.comm.local import LocalCommunicator
from pipeline.train.config import TrainConfig


@pytest.mark.parametrize("name,params,match", [
    ("swarm", {"schedule": "time"}, "round_seconds"),
    ("swarm", {"topology": "regular"}, "degree"),
    ("swarm", {"local_steps": 0}, "local_steps"),
    ("swarm", {"weighting": "loudest"}, "weighting"),
    ("swarm", {"bogus": 1}, "unknown config key algorithm.params.bogus"),
    ("dpsgd", {"order": "sideways"}, "order"),
    ("easgd", {"alpha": 0.1, "rho": 1.0}, "alpha or rho"),
    ("easgd", {"beta": 1.5}, "beta"),
    ("timed_local_sgd", {}, "round_seconds"),
    ("slowmo", {"base": "swarm", "base_params": {"schedule": "time"}}, "round_seconds"),
])
def test_bad_params_are_one_line_config_errors(name, params, match):
    with pytest.raises(ConfigError, match=match) as e:
        validate_params(name, params)
    assert "\n" not in str(e.value)


def test_train_config_accepts_algorithms_and_stragglers():
    cfg = TrainConfig(algorithm={"name": "swarm", "params": {"schedule": "geometric", "local_steps": 3}},
                      stragglers={"slowdown": {1: 2.0}, "delay_s": 0.05, "delay_prob": 0.1})
    assert cfg.stragglers.slowdown == {1: 2.0}
    with pytest.raises(Exception, match="slowdown"):
        TrainConfig(stragglers={"slowdown": {1: 0.5}})


def _ctx():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm = LocalCommunicator()
    return BuildContext(model, opt, comm, ModelAverager(model, opt, comm, "average", "reset")), model


@pytest.mark.parametrize("name,params,cls", [
    ("swarm", {"local_steps": 2}, "SwarmSGD"),
    ("dpsgd", {}, "DPSGD"),
    ("easgd", {"tau": 2}, "EASGD"),
    ("timed_local_sgd", {"round_seconds": 0.01}, "TimedLocalSGD"),
    ("slowmo", {"base": "dpsgd", "tau": 2}, "SlowMo"),
    ("slowmo", {"base": "easgd", "tau": 2, "average": False}, "SlowMo"),
    ("slowmo", {"base": "swarm", "base_params": {"local_steps": 2}, "tau": 4}, "SlowMo"),
    ("slowmo", {"base": "swarm", "base_params": {"schedule": "time", "round_seconds": 0.01}, "tau": 2}, "RoundSlowMo"),
    ("slowmo", {"base": "timed_local_sgd", "base_params": {"round_seconds": 0.01}, "tau": 2}, "RoundSlowMo"),
])
def test_registry_builds_and_steps(name, params, cls):
    ctx, model = _ctx()
    algo = build_algorithm(name, params, ctx)
    assert type(algo).__name__ == cls
    x = torch.randn(16, 4)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(6):
        algo.zero_grad()
        model(x).pow(2).mean().backward()
        algo.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_geometric_local_steps_mean_and_reproducible():
    a = LocalSteps("geometric", 4, seed=3, rank=1)
    draws = []
    for r in range(4000):
        a.start_round(r)
        draws.append(a.target)
    assert min(draws) >= 1 and 3.7 < sum(draws) / len(draws) < 4.3
    b = LocalSteps("geometric", 4, seed=3, rank=1)
    b.start_round(17)
    a.start_round(17)
    assert a.target == b.target
    c = LocalSteps("geometric", 4, seed=3, rank=2)
    assert [c.start_round(r) or c.target for r in range(50)] != [a.start_round(r) or a.target for r in range(50)]


def test_time_schedule_counts_wall_clock():
    now = [0.0]
    s = LocalSteps("time", 4, round_seconds=0.5, clock=lambda: now[0])
    s.start_round(0)
    now[0] = 0.2
    assert not s.due(3)
    now[0] = 0.5
    assert s.due(1)
    s.reset_clock()
    assert not s.due(10)
