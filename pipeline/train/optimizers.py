"""Base optimizers of a worker: SGD with momentum, Adam, LARS, and a gradient-descent warmup stage.

* ``sgd``, ``adam``: torch's own.
* ``lars``: layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017, Algorithm 1) on SGD
  with momentum. For each weight tensor w with gradient g, weight decay beta, trust coefficient
  eta and the scheduled rate lr::

      local = eta * ||w|| / (||g|| + beta * ||w||)      (1 when either norm is 0)
      v     = m * v + lr * local * (g + beta * w)
      w     = w - v

  Tensors of one dimension (biases, BatchNorm scales and shifts) take ``local = 1``, as is usual.
  The momentum buffer is stored as ``momentum_buffer`` (what the averaging policy averages).
* ``warmup_optimizer: sgd`` (Wongpanich, You & Demmel 2020, Figure 3: "Gradient Descent
  Optimizer during the warmup and then Adam Optimizer once warmup is complete"):
  :class:`GDThenAdam` takes plain gradient-descent steps ``w -= lr * (g + beta * w)`` for its
  first ``switch_step`` steps, then Adam steps (torch's update, bias correction counted from the
  switch) with the same parameter groups, so the algorithms that hold the optimizer keep it.
"""
from __future__ import annotations

import torch


def _closure_loss(closure):
    """torch's optimizer convention: re-evaluate the loss with gradients enabled when given a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio (see the module docstring)."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001):
        if lr <= 0 or eta <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"LARS: bad lr={lr}, eta={eta}, momentum={momentum} or weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, m, wd, eta = group["lr"], group["momentum"], group["weight_decay"], group["eta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                local = 1.0
                if p.ndim > 1:
                    w_norm, g_norm = float(torch.linalg.vector_norm(p)), float(torch.linalg.vector_norm(g))
                    if w_norm > 0 and g_norm > 0:
                        local = eta * w_norm / (g_norm + wd * w_norm)
                d = g.add(p, alpha=wd) if wd else g.clone()
                st = self.state[p]
                buf = st.get("momentum_buffer")
                if buf is None:
                    buf = st["momentum_buffer"] = torch.zeros_like(p)
                buf.mul_(m).add_(d, alpha=lr * local)
                p.sub_(buf)
        return loss


class GDThenAdam(torch.optim.Optimizer):
    """Plain gradient descent for ``switch_step`` steps, then Adam (see the module docstring)."""

    def __init__(self, params, lr: float = 1e-3, switch_step: int = 0, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if lr <= 0 or switch_step < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"GDThenAdam: bad lr={lr}, switch_step={switch_step}, eps={eps} or "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, switch_step=int(switch_step), betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        for group in self.param_groups:  # saved with the groups in state_dict(); not a constructor argument
            group.setdefault("steps_done", 0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            adam_t = group["steps_done"] - group["switch_step"] + 1  # 1-based Adam step, <= 0 while warming up
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.add(p, alpha=wd) if wd else p.grad
                if adam_t <= 0:
                    p.sub_(g, alpha=lr)
                    continue
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / (1 - b2 ** adam_t) ** 0.5).add_(group["eps"])
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** adam_t))
            group["steps_done"] += 1
        return loss


def make_optimizer(cfg, params, switch_step: int = 0):
    """The base optimizer of ``cfg`` (a TrainConfig); ``switch_step``: the end of a
    gradient-descent warmup stage when ``cfg.warmup_optimizer`` is ``sgd``."""
    if cfg.warmup_optimizer == "sgd":
        return GDThenAdam(params, lr=cfg.lr, switch_step=switch_step, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":
        return LARS(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, eta=cfg.lars_eta)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
