"""Every registered algorithm's checkpoint state is tensors and plain data: a real 2-worker run
(local launcher: torch.distributed processes) of each entry of ``algorithms.REGISTRY`` writes
checkpoints whose rank files load with ``torch.load(..., weights_only=True)`` and hold the same
state as a full unpickling of the same bytes (the round trip loses nothing)."""
from __future__ import annotations

import pytest
import torch

from pipeline.train.algorithms import REGISTRY
from pipeline.train.config import TrainConfig

pytest_plugins = ["train_fixtures"]
pytestmark = pytest.mark.slow

#: small working parameters of every registered algorithm (a new algorithm needs its row here)
PARAMS = {
    "arsgd": {},
    "local_sgd": {"period": 2},
    "post_local_sgd": {"switch_step": 2, "period": 2},
    "hierarchical": {"household_period": 1, "neighbourhood_period": 2, "world_period": 4, "household_size": 1,
                     "neighbourhood_size": 2},
    "slowmo": {"base": "local_sgd", "base_params": {"period": 2}, "tau": 2},
    "swarm": {"local_steps": 2},
    "dpsgd": {},
    "easgd": {"tau": 2},
    "timed_local_sgd": {"round_seconds": 0.05, "nominal_steps": 2},
    "adpsgd": {"round_steps": 2},
    "eawild": {"round_steps": 2, "group_size": 1},
    "async_ps": {"round_steps": 2},
}


def test_every_registered_algorithm_has_parameters_here():
    assert set(PARAMS) == set(REGISTRY)


def _same(a, b, where="state") -> None:
    """``a`` (weights_only) equals ``b`` (full unpickling): tensors equal, containers alike."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), where
        for k in b:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), where  # NaN equals NaN here


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_an_algorithms_checkpoints_load_with_weights_only_and_round_trip(tmp_path, name):
    from train_fixtures import write_digit_shards

    from pipeline.train.launch import train

    man = write_digit_shards(tmp_path / "shards", workers=2, n_train=128, n_test=32, n_val=32, row_group_rows=32)
    out = tmp_path / "out"
    train(TrainConfig(manifest=str(man), output=str(out), launcher="local", epochs=1, batch_size=16, optimizer="sgd",
                      lr=0.05, checkpoint_every=2, keep_checkpoints=0, progress=False,
                      algorithm={"name": name, "params": PARAMS[name]}))
    files = sorted((tmp_path / "out-checkpoints").glob("step_*/rank_*.pt"))
    assert len(files) >= 4 and {f.name for f in files} == {"rank_000.pt", "rank_001.pt"}
    for f in files:
        safe = torch.load(f, map_location="cpu", weights_only=True)
        assert set(safe) == {"model", "optimizer", "algorithm", "rng"}, f
        _same(safe, torch.load(f, map_location="cpu", weights_only=False), f"{f.parent.name}/{f.name}")
