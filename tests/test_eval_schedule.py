"""The evaluation schedule of the step-driven driver (pipeline/train/drivers.py): validation every
``eval_every`` steps and always at the run's last step, once. E2.3 at B = 4096 ran 210 steps with
``eval_every`` = 14: the last step is a multiple of the period, and the run must be scored there."""
from __future__ import annotations

import json

import pytest

from pipeline.train.config import TrainConfig
from pipeline.train.launch import train
from train_fixtures import write_digit_shards


@pytest.fixture(scope="module")
def digits2(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("digits2"), workers=2, n_train=256, n_test=64, n_val=64)


def _val_steps(out) -> list[int]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in recs if r.get("split") == "val"]


@pytest.mark.parametrize("max_steps, want", [(6, [3, 6]), (7, [3, 6, 7])])
def test_a_run_is_validated_at_its_last_step_once(digits2, tmp_path, max_steps, want):
    """6 steps, a validation every 3: step 3 and the last step 6 (the last step a multiple of the
    period, E2.3's case); 7 steps: 3, 6 and the last step 7. Never twice at one step."""
    cfg = TrainConfig(manifest=str(digits2), output=str(tmp_path / "run"), launcher="inprocess", model="lenet5",
                      epochs=1, batch_size=16, optimizer="sgd", lr=0.05, momentum=0.9, eval_every=3,
                      max_steps=max_steps, progress=False, algorithm={"name": "arsgd"})
    summary = train(cfg)
    assert summary["steps"] == max_steps
    assert _val_steps(tmp_path / "run") == want
