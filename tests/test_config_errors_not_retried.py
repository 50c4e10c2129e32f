"""Configuration errors are never retried (issue 34, item 7).

* EA-wild's moving rate alpha = lr x rho must lie in (0, 1): refused when the config is read, in one
  line naming the values; a scheduled rate that takes it out of (0, 1) later is a ConfigError in
  the worker (exit 2, not restarted), never a silent divergence.
* A ValueError raised in a worker (a bad setting the driver did not check) is not a transient
  failure: the supervisor does not relaunch it ``max_restarts`` times.
"""
from __future__ import annotations

import logging
import types

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.train import restart
from pipeline.train.config import TrainConfig


def _eawild(tmp_path, params, **kw):
    return TrainConfig(manifest="m.json", output=str(tmp_path / "out"), launcher="local",
                       algorithm={"name": "eawild", "params": params}, **kw)


# ---------------------------------------------------------------------------- EA-wild: alpha = lr x rho in (0, 1)
@pytest.mark.parametrize("kw,params,named", [
    ({"lr": 0.1}, {"rho": 20}, ["rho=20", "lr=0.1", "alpha", "= 2"]),
    ({"lr": 0.5}, {"rho": 2}, ["rho=2", "lr=0.5", "= 1"]),                    # 1 itself is outside (0, 1)
    ({"lr": 0.1, "workers": 4}, {"rho": 5}, ["rho=5", "workers=4", "= 2"]),  # linear scaling: the scaled lr 0.4
    ({"lr": 0.001, "optimizer": "adam", "warmup_optimizer": "sgd", "warmup_lr": 2.0}, {"rho": 1},
     ["rho=1", "warmup_lr=2", "= 2"]),
])
def test_eawild_alpha_outside_0_1_is_refused_when_the_config_is_read(tmp_path, kw, params, named):
    with pytest.raises(ConfigError) as e:
        _eawild(tmp_path, params, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "algorithm.params.rho" in msg and "(0, 1)" in msg, msg
    assert all(n in msg for n in named), msg
    assert e.value.exit_code == 2


def test_eawild_alpha_inside_0_1_is_accepted(tmp_path):
    _eawild(tmp_path, {"rho": 5}, lr=0.1)                                  # alpha 0.5
    _eawild(tmp_path, {"rho": 5}, lr=0.1, workers=1)                       # scaled lr 0.1
    _eawild(tmp_path, {"rho": 5}, lr=0.1, workers=4, lr_scaling="none")    # no scaling: 0.5
    _eawild(tmp_path, {"alpha": 0.5}, lr=10.0)                             # a fixed alpha does not involve lr
    TrainConfig(manifest="m.json", output=str(tmp_path / "o"), lr=0.5,     # other algorithms: no such rule
                algorithm={"name": "easgd", "params": {"alpha": 0.5}})


def test_eawild_rate_leaving_0_1_during_the_run_is_a_config_error_naming_the_values():
    """The rate a worker reaches (warmup to lr x M when the workers come from the manifest) is
    checked where alpha is taken: a ConfigError (exit 2, never restarted), not a silent overshoot."""
    from pipeline.train.algorithms.eawild import EAWild

    x = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([x], lr=0.1)
    alg = types.SimpleNamespace(rho=5.0, optimizer=opt, _alpha=None)
    assert EAWild.alpha.fget(alg) == pytest.approx(0.5)
    opt.param_groups[0]["lr"] = 0.4                     # e.g. lr 0.1 scaled by 4 workers after the warmup
    with pytest.raises(ConfigError) as e:
        EAWild.alpha.fget(alg)
    msg = str(e.value)
    assert "\n" not in msg and "rho=5" in msg and "lr=0.4" in msg and "(0, 1)" in msg, msg
    assert not restart.is_restartable(e.value)


# ---------------------------------------------------------------------------- a ValueError is not transient
def _cfg(tmp_path, **kw):
    return TrainConfig(manifest="m.json", output=str(tmp_path / "out"), **kw)


@pytest.mark.parametrize("exc", [
    ValueError("bad setting"),                                                   # one rank's, raised as is
    RuntimeError("rank 0: ValueError: bad setting; rank 1: ValueError: bad setting"),   # several local ranks
    RuntimeError("Horovod job failed: ... ValueError: household_size=3 and neighbourhood_size=2 ..."),
])
def test_a_value_error_from_a_worker_is_not_relaunched(tmp_path, exc, caplog):
    calls = []

    def launch(c, resume_from):
        calls.append(resume_from)
        raise exc

    with caplog.at_level(logging.WARNING), pytest.raises(restart.TrainingFailed) as e:
        restart.supervise(launch, _cfg(tmp_path, max_restarts=3), tmp_path / "ck", {}, None)
    assert len(calls) == 1, calls
    assert not any("restart" in r.getMessage() for r in caplog.records)
    msg = str(e.value)
    assert "\n" not in msg and "ValueError" in msg and "not restarted" in msg, msg
    assert not restart.is_restartable(exc)


def test_a_lost_worker_whose_peers_reported_a_value_error_is_still_restarted():
    assert restart.is_restartable(
        restart.WorkerLost("rank 1: worker process died (killed by SIGKILL); then rank 0: ValueError: x", 1))


@pytest.mark.timeout(600)
def test_a_bad_setting_that_raises_value_error_in_real_workers_ends_the_run_at_once(tmp_path, caplog):
    """Two local worker processes building the hierarchical algorithm with household_size=3 for 2
    workers: each raises ValueError; the run ends after one launch, not after max_restarts more."""
    from train_fixtures import write_digit_shards

    from pipeline.train.launch import train

    man = write_digit_shards(tmp_path / "shards", workers=2, n_train=128, n_test=32, n_val=32, row_group_rows=32)
    cfg = TrainConfig(manifest=str(man), output=str(tmp_path / "out"), launcher="local", epochs=1, batch_size=16,
                      optimizer="sgd", lr=0.05, progress=False, max_restarts=2,
                      algorithm={"name": "hierarchical", "params": {"household_size": 3}})
    with caplog.at_level(logging.WARNING), pytest.raises(restart.TrainingFailed) as e:
        train(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "ValueError" in msg and "household_size=3" in msg and "not restarted" in msg, msg
    assert not any("restart 1/" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "out").exists()
