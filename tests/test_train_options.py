"""The training options the source protocols need, each against an independent computation:
step decay and warmups (pipeline.train.lr_schedule), the batch rules of Eq. A.3 (Håland & Birkeland
2020, Appendix A), LARS and the gradient-descent-then-Adam warmup optimizer
(pipeline.train.optimizers), He initialisation (pipeline.train.models) and the crop-and-flip
augmentation (pipeline.train.augment)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.shards.manifest import LayoutSpec
from pipeline.train.augment import crop_flip
from pipeline.train.config import TrainConfig
from pipeline.train.models import build_model
from pipeline.train.optimizers import LARS, GDThenAdam, make_optimizer
from pipeline.train.lr_schedule import (household_local_batch, household_lr_factor, local_batch, lr_at, lr_factor,
                                     plan_terms)


# ----------------------------------------------------------------------------- schedule
def test_step_decay_of_e1():
    """E1: 0.1, divided by 10 at 50% and 75% of 64k iterations (here 400 steps)."""
    decay = [200, 300]
    got = [lr_at(s, 0.1, 1.0, 0, decay) for s in (0, 199, 200, 299, 300, 399)]
    assert got == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def test_warmup_rises_from_base_to_scaled_rate_then_decays():
    """E3.2.3: linear from 0.1 to 0.1 * factor over the warmup, then the decays apply to the target."""
    f = household_lr_factor(8, 128)
    w = 10
    assert lr_at(0, 0.1, f, w) == pytest.approx(0.1 + (0.1 * f - 0.1) * 1 / w)
    assert lr_at(4, 0.1, f, w) == pytest.approx(0.1 + (0.1 * f - 0.1) * 5 / w)
    assert lr_at(9, 0.1, f, w) == pytest.approx(0.1 * f)
    assert lr_at(50, 0.1, f, w, decay_at=[40]) == pytest.approx(0.01 * f)


def test_gradient_descent_warmup_rate():
    """The two-stage warmup: the warmup stage rises to warmup_lr, then the optimizer's own rate."""
    assert [lr_at(s, 1e-3, 1.0, 4, warmup_lr=0.2) for s in range(6)] == pytest.approx(
        [0.05, 0.1, 0.15, 0.2, 1e-3, 1e-3])


def test_eq_a3_numbers_of_the_thesis():
    """Appendix A / E3.2.2 footnote 2: B_e = 128, M = 16, H = 8, L_W = 128 gives B_local = 61 and
    ceil(45000 / (16 * 61)) * 182 = 8554 iterations; L_W = 1 gives B_g / M = 8."""
    b = household_local_batch(128, 16, 8, 128)
    assert b == 61
    assert math.ceil(45000 / (16 * b)) * 182 == 8554
    assert household_local_batch(128, 16, 4, 1) == 8
    exact = 128 * 32 * 4 / (16 * (4 + 32 - 1))  # 29.26...
    assert household_local_batch(128, 16, 4, 32) == round(exact)
    assert household_lr_factor(8, 128) == pytest.approx(128 * 8 / 135)
    assert household_lr_factor(2, 1) == pytest.approx(1.0)


def test_batch_rules_and_scalings():
    assert local_batch("local", 32, 16) == 32
    assert local_batch("global", 128, 16) == 8
    with pytest.raises(ConfigError, match="batch_size=100"):
        local_batch("global", 100, 16)
    with pytest.raises(ConfigError, match="household"):
        local_batch("household", 128, 16)
    assert lr_factor("linear", 16) == 16.0 and lr_factor("none", 16) == 1.0
    with pytest.raises(ConfigError, match="lr_scaling='household'"):
        lr_factor("household", 16)


def test_plan_terms_read_households_and_the_world_period():
    """A households layout has one neighbourhood, the world: its neighbourhood period is L_W."""
    cfg = TrainConfig(batch_size=128, batch_rule="household", lr_scaling="household", lr_decay_at=[0.5, 0.75],
                      algorithm={"name": "hierarchical",
                                 "params": {"household_period": 1, "neighbourhood_period": 64, "world_period": 128}})
    hh = LayoutSpec(scheme="households", workers=16, copies=4, households=8, household_shards=2)
    t = plan_terms(cfg, hh, 16, lambda b: 1000 // b)
    assert t["batch_size"] == household_local_batch(128, 16, 8, 64)
    assert t["lr_factor"] == pytest.approx(64 * 8 / (8 + 64 - 1))
    assert t["decay_steps"] == [round(0.5 * (1000 // t["batch_size"])), round(0.75 * (1000 // t["batch_size"]))]
    nb = LayoutSpec(scheme="neighbourhoods", workers=16, copies=1, households=8, neighbourhoods=2)
    assert plan_terms(cfg, nb, 16, lambda b: 10)["batch_size"] == household_local_batch(128, 16, 8, 128)
    flat = TrainConfig(batch_size=128, batch_rule="global", lr_scaling="none")
    t = plan_terms(flat, LayoutSpec(scheme="disjoint", workers=16, copies=1), 16, lambda b: 10)
    assert (t["batch_size"], t["lr_factor"], t["decay_steps"]) == (8, 1.0, [])


def test_config_refuses_inconsistent_options():
    with pytest.raises(ConfigError, match="warmup_optimizer"):
        TrainConfig(warmup_optimizer="sgd", optimizer="adam", warmup_epochs=2)  # no warmup_lr
    with pytest.raises(ConfigError, match="warmup_optimizer"):
        TrainConfig(warmup_optimizer="sgd", optimizer="sgd", warmup_lr=0.1, warmup_epochs=2)
    with pytest.raises(ConfigError, match="lr_decay_at"):
        TrainConfig(lr_decay_at=[0.75, 0.5])
    with pytest.raises(ConfigError, match="nesterov"):
        TrainConfig(optimizer="lars", nesterov=True)


# ----------------------------------------------------------------------------- optimizers
def _grads(shapes, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=s) for s in shapes] for _ in range(steps)]


def test_lars_against_algorithm_1():
    """You et al. 2017, Algorithm 1, written out in numpy (1-D tensors: trust ratio 1)."""
    shapes = [(3, 4), (4,)]
    rng = np.random.default_rng(1)
    w0 = [rng.normal(size=s) for s in shapes]
    lrs, m, wd, eta = [0.5, 0.4, 0.3], 0.9, 1e-3, 0.01
    grads = _grads(shapes, len(lrs))
    params = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in w0]
    opt = LARS(params, lr=0.5, momentum=m, weight_decay=wd, eta=eta)
    w = [x.copy() for x in w0]
    v = [np.zeros(s) for s in shapes]
    for lr, gs in zip(lrs, grads):
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g)
        opt.param_groups[0]["lr"] = lr
        opt.step()
        for i, g in enumerate(gs):
            local = eta * np.linalg.norm(w[i]) / (np.linalg.norm(g) + wd * np.linalg.norm(w[i])) if w[i].ndim > 1 \
                else 1.0
            v[i] = m * v[i] + lr * local * (g + wd * w[i])
            w[i] = w[i] - v[i]
    for p, ref in zip(params, w):
        np.testing.assert_allclose(p.detach().numpy(), ref, rtol=1e-12)
    assert "momentum_buffer" in opt.state[params[0]]


def test_gd_then_adam_is_gd_then_torch_adam():
    """The warmup stage is plain gradient descent; from the switch on, torch's Adam started there."""
    shapes, switch, n = [(5, 3), (3,)], 3, 7
    grads = _grads(shapes, n, seed=2)
    start = [torch.randn(*s, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) for s in shapes]
    mine = [torch.nn.Parameter(t.clone()) for t in start]
    opt = GDThenAdam(mine, lr=1e-2, switch_step=switch, weight_decay=1e-4)
    ref = [t.clone() for t in start]
    adam_params, adam = None, None
    for k, gs in enumerate(grads):
        lr = 0.05 * (k + 1) if k < switch else 1e-2
        opt.param_groups[0]["lr"] = lr
        for p, g in zip(mine, gs):
            p.grad = torch.tensor(g)
        opt.step()
        if k < switch:
            ref = [r - lr * (torch.tensor(g) + 1e-4 * r) for r, g in zip(ref, gs)]
            continue
        if adam is None:
            adam_params = [torch.nn.Parameter(r.clone()) for r in ref]
            adam = torch.optim.Adam(adam_params, lr=1e-2, weight_decay=1e-4)
        for p, g in zip(adam_params, gs):
            p.grad = torch.tensor(g)
        adam.step()
        ref = [p.detach() for p in adam_params]
    for p, r in zip(mine, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)
    state = opt.state_dict()
    again = GDThenAdam([torch.nn.Parameter(t.clone()) for t in start], lr=1e-2, switch_step=switch)
    again.load_state_dict(state)
    assert again.param_groups[0]["steps_done"] == n


def test_make_optimizer_picks_each_kind():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(make_optimizer(TrainConfig(optimizer="lars", lr=0.1), p), LARS)
    assert isinstance(make_optimizer(TrainConfig(optimizer="sgd"), p), torch.optim.SGD)
    two = make_optimizer(TrainConfig(optimizer="adam", warmup_optimizer="sgd", warmup_lr=0.1, warmup_epochs=1), p,
                         switch_step=5)
    assert isinstance(two, GDThenAdam) and two.param_groups[0]["switch_step"] == 5


# ----------------------------------------------------------------------------- init and augmentation
def test_he_init_draws_normal_with_std_sqrt_2_over_fan_in():
    torch.manual_seed(0)
    he = build_model("hlf", 3, init="he")
    torch.manual_seed(0)
    default = build_model("hlf", 3)
    first = he.net[0]
    w = first.weight.detach().numpy().ravel()
    want = math.sqrt(2 / first.in_features)
    assert abs(w.std() - want) < 0.1 * want  # 700 draws: the std estimate is within 3% at 1 sigma
    assert float(first.bias.detach().abs().max()) == 0.0
    bound = 1 / math.sqrt(first.in_features)  # torch's default is uniform within +-1/sqrt(fan_in)
    assert np.abs(default.net[0].weight.detach().numpy()).max() <= bound
    assert np.abs(w).max() > bound
    big = build_model("lenet5", 10, {"channels": 1, "height": 28, "width": 28}, init="he")
    fc1 = big.fc1.weight.detach().numpy().ravel()
    assert fc1.std() == pytest.approx(math.sqrt(2 / big.fc1.in_features), rel=0.02)  # 48,000 draws


def test_crop_flip_is_a_padded_crop_possibly_mirrored():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(64, 3, 8, 8, generator=g)
    out = crop_flip(x, pad=2, generator=torch.Generator().manual_seed(4))
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    flips, moved = 0, 0
    for i in range(len(x)):
        hits = [(dy, dx, f) for dy in range(5) for dx in range(5) for f in (False, True)
                if torch.equal((lambda c: c.flip(-1) if f else c)(padded[i, :, dy:dy + 8, dx:dx + 8]), out[i])]
        assert hits, f"image {i} is not a crop of its padded input"
        flips += all(f for _, _, f in hits)
        moved += all((dy, dx) != (2, 2) for dy, dx, _ in hits)
    assert 16 < flips < 48 and moved > 32
