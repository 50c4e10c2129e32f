"""EA-wild (Wongpanich et al. 2020, Algorithm 1): asynchronous elastic averaging, lock-free centre.

A centre variable ``c`` (the paper's w~) lives on the holder, rank 0
(:class:`~.centre.CentreHolder`; rank 0's own training thread reaches it in memory). Every
``tau`` local steps worker j does, with ``alpha = lr * rho`` (the paper's eta * rho) or a fixed
``alpha``, where ``x_j`` is its model before this step (the model its gradient ``g_j`` was
computed at) and ``c_j`` the centre it pulled::

    push x_j;  holder, on arrival:  c <- c + alpha * (x_j - c);  reply c  (the next pull)   eq. (3)
    x_j <- x_j - lr * g_j - alpha * (x_j - c_j)                                            eq. (2)

(``- lr * g_j`` is the base optimizer's step: SGD's, or Adam's / momentum's update). The
master thus gets the worker's model BEFORE the worker's elastic move, and both moves use the
values before the update. The holder applies arrivals one after the other **without a lock
between a worker's pull and its push**: other workers' pushes may land in between (staleness =
centre updates between the pull and the push). A remote worker's push runs on its link's
thread while the worker computes its next gradient; the reply is taken just before the next
elastic move, its only use. ``lock=True`` is the locked asynchronous EASGD of Zhang et al. 2015
that EA-wild improves on: pull, push and the centre's update are one critical section on the
holder, so every worker moves towards the newest centre and the run is exactly sequential
EASGD in the holder's grant order (``CentreHolder.order``); the waiting it costs is measured
(idle fraction).

Rounds end as described in :mod:`.async_common`. The final model is the world average of the
workers (the round loop's last average); the centre is evaluated too
(:meth:`EAWild.extra_evaluations`).

Grouping (the paper's option; ``group_size`` G > 1, M divisible by G): ranks ``[gG, (g+1)G)`` form
group g and are synchronous: every ``tau`` local steps the group averages in one allreduce on its
own process group, and only its leader (rank ``gG``) talks to the centre. The group is one worker
of Algorithm 1 whose model is the members' mean ``w = mean_i x_i`` (before the step) and whose
step is the mean of the members' steps: the leader pushes ``w`` and everyone leaves with
``mean_i(x_i - lr g_i) - alpha (w - c_l)`` (``c_l``: the centre the leader pulled; the
allreduce carries ``[x_i, x_i - lr g_i - alpha x_i (+ G alpha c_l on the leader), round flag]``).
G = M is one pusher (rank 0, in memory). In time mode a grouped round ends only at an exchange,
when the clock of any group member says so (the flag), so the members always take the same
number of steps.

Drag compensation (``compensate: true``; off by default, i.e. Algorithm 1 as published): the
centre is a member without gradients, so once the gaps have settled the system moves at ``1/f``
of the workers' gradient speed, ``f = drag_factor(alpha, M, G, lock)`` (docs/async.md derives
it). With the option every gradient step is multiplied by ``f`` (the optimizer's learning rate
for that step), so the system moves at AR-SGD's speed per sample, as the linear scaling rule
makes the other algorithms do.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

import torch
from pydantic import Field, model_validator

from ...errors import ConfigError
from ..comm.fusion import flatten, unflatten_
from . import BuildContext, Spec
from .async_common import AsyncParams, base_algorithm, future_done
from .centre import CentreAlgorithm


def drag_factor(alpha: float, workers: int, group_size: int = 1, locked: bool = False) -> float:
    """The factor ``f`` by which EA-wild's centre slows the system's mean-field velocity (to
    ``1/f`` of the workers' gradient speed; docs/async.md, "Why EA-wild trails in samples"):
    ``f = 1 + G / M + alpha * s * G / M`` with P = M/G pushers and ``s`` the pushes that land
    between a pusher's pull and its push: ``P - 1`` lock-free (each reply is the pull of the
    next push, and the other pushers take their turn in between), 0 with the lock."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"EA-wild drag compensation needs a moving rate alpha in (0, 1), got {alpha:g}")
    pushers = workers // group_size
    stale = 0 if locked else pushers - 1
    return 1.0 + group_size / workers + alpha * stale * group_size / workers


def _rate_error(rho: float, rate: float, formula: str, values: str) -> ConfigError:
    """One line: alpha = <formula> x rho = <rate> x rho = alpha, with the values it came from."""
    return ConfigError(f"invalid config value algorithm.params.rho={rho:g}: EA-wild's moving rate alpha = {formula} "
                       f"x rho = {rate:g} x {rho:g} = {rate * rho:g} ({values}) must lie in (0, 1) (Wongpanich et al. "
                       "2020: alpha = eta rho); lower rho or the rate, or give a fixed alpha")


def check_moving_rate(cfg) -> None:
    """EA-wild with ``rho``: alpha = lr x rho must lie in (0, 1) at every rate the config names (a
    TrainConfig: ``lr``, the gradient-descent warmup's ``warmup_lr``, and ``lr x workers`` under
    linear scaling when ``workers`` is given). One line naming the values; the rate a run reaches
    from the manifest's workers is checked where alpha is taken (:attr:`EAWild.alpha`)."""
    base, params = base_algorithm(cfg.algorithm.name, cfg.algorithm.params)
    if base != "eawild" or params.get("rho") is None:
        return
    rho = float(params["rho"])
    rates = [(cfg.lr, "lr", f"lr={cfg.lr:g}")]
    if cfg.warmup_optimizer == "sgd" and cfg.warmup_lr is not None:
        rates.append((cfg.warmup_lr, "warmup_lr", f"warmup_lr={cfg.warmup_lr:g}, the warmup's peak rate"))
    if cfg.lr_scaling == "linear" and cfg.workers:
        rates.append((cfg.lr * cfg.workers, "lr x workers",
                      f"lr={cfg.lr:g}, workers={cfg.workers}, lr_scaling=linear: the rate after the warmup"))
    for rate, formula, values in rates:
        if not 0.0 < rate * rho < 1.0:
            raise _rate_error(rho, rate, formula, values)


def elastic_rule(c: torch.Tensor, payload: torch.Tensor) -> None:
    """payload = [x_j, alpha]:  c <- c + alpha * (x_j - c)."""
    c.add_(payload[:-1] - c, alpha=float(payload[-1]))


class EAWildParams(AsyncParams):
    """``algorithm.params`` of ``eawild``."""

    tau: int = Field(1, ge=1, description="local steps between two pushes")
    alpha: Optional[float] = Field(None, gt=0, lt=1, description="moving rate (default 0.1 when rho is not given)")
    rho: Optional[float] = Field(None, gt=0, description="elastic coefficient: alpha = lr * rho, in (0, 1) at "
                                                         "every rate of the run")
    lock: bool = Field(False, description="locked asynchronous EASGD (pull-update-push atomic) instead of EA-wild")
    group_size: int = Field(1, ge=1, description="workers per synchronous group (one leader pushes); divides the "
                                                 "number of workers; 1 = no grouping")
    compensate: bool = Field(False, description="multiply each gradient step by drag_factor(alpha, M, G), so the "
                                                "workers and the centre move at AR-SGD's speed per sample")

    @model_validator(mode="after")
    def _one(self):
        if self.alpha is not None and self.rho is not None:
            raise ValueError("give alpha or rho, not both")
        return self


class EAWild(CentreAlgorithm):
    name = "eawild"
    rule = staticmethod(elastic_rule)

    def __init__(self, params, optimizer, comm, averager=None, *, tau: int = 1, alpha: Optional[float] = None,
                 rho: Optional[float] = None, lock: bool = False, group_size: int = 1, compensate: bool = False,
                 **kw) -> None:
        super().__init__(params, optimizer, comm, averager, group_size=group_size, **kw)
        self._group_due = False
        self.tau, self.rho, self.locked, self.compensate = int(tau), rho, bool(lock), bool(compensate)
        self._inflight: Optional[Future] = None   # a remote pusher's push whose reply has not been taken
        self._alpha = 0.1 if alpha is None and rho is None else alpha

    @property
    def alpha(self) -> float:
        if self.rho is not None:
            lr = float(self.optimizer.param_groups[0]["lr"])
            if not 0.0 < lr * self.rho < 1.0:   # a scheduled rate (warmup to lr x M, ...) took it out of (0, 1)
                raise _rate_error(self.rho, lr, "lr", f"lr={lr:g}, the learning rate of this step")
            return lr * self.rho
        return float(self._alpha)

    def local_step(self) -> None:
        a = self.alpha   # before the step's learning rate is scaled (alpha = lr * rho)
        if self.comm.world_size == 1 or (self.step_count + 1) % self.tau:
            with self.lock:
                self._gradient_step(a)
        elif self.group is None:
            self._exchange(a)
        else:
            self._group_exchange(a)

    def _gradient_step(self, a: float) -> None:
        """The base optimizer's step (its learning rate times the drag factor with ``compensate``);
        call with the model lock held."""
        if not (self.compensate and self.comm.world_size > 1):
            self.optimizer.step()
            return
        f = drag_factor(a, self.comm.world_size, self.group_size, self.locked)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * f
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr

    def _pull(self) -> torch.Tensor:
        """The centre this pusher moves towards: with the lock the current one (taken with the
        lock), else its last pull (the reply to its previous push, taken now if still in flight)."""
        if self.locked:
            return self.link.acquire()
        if self._inflight is not None:
            self.pulled = self.link.settle(self._settle_inflight())
        return self.pulled

    def _settle_inflight(self) -> Future:
        f, self._inflight = self._inflight, None
        return f

    def _push(self, w: torch.Tensor, a: float) -> None:
        """Push the pusher's model ``w`` (before its elastic move) with the moving rate."""
        payload = torch.cat([w, torch.tensor([a], dtype=w.dtype)])
        if self.locked:
            self.pulled = self.link.push_locked(payload)
        elif self.holder is None:   # a remote pusher: the reply comes while it computes
            self._inflight = self.link.push_async(payload)
        else:
            self.pulled = self.link.push(payload)

    def _exchange(self, a: float) -> None:
        """Algorithm 1 for one worker: push x (before the step), then x <- x - lr g - a (x - c_pulled)."""
        with self.lock:
            x = flatten(self.tensors, device="cpu")
        c = self._pull()
        self._push(x, a)
        with self.lock:
            self._gradient_step(a)
            unflatten_(x - c.to(x.dtype), self.tensors, add=-a)

    def _group_exchange(self, a: float) -> None:
        """Algorithm 1 for a group (see module docstring): one allreduce of the group, the leader
        pulls before it and pushes the group's mean after it. Carries the time-mode round flag."""
        g, n = self.group_size, self.numel
        due = self.round_seconds is not None and self.clock() - self._round_t0 >= self.round_seconds
        leads = self.comm.rank == self.leader
        c = self._pull() if leads else None
        with self.lock:
            pre = flatten(self.tensors, device="cpu")
            self._gradient_step(a)
            v = torch.cat([pre, flatten(self.tensors, device="cpu") - a * pre,
                           torch.tensor([g * float(due)], dtype=pre.dtype)])
        if c is not None:
            v[n:2 * n].add_(c.to(pre.dtype), alpha=g * a)
        t0 = self.clock()
        self.host.allreduce_mean_([v], group=self.group)
        self.stats.add_idle(self.clock() - t0)
        self._group_due = bool(v[-1] > 0)
        with self.lock:
            unflatten_(v[n:2 * n], self.tensors)
        if leads:
            self._push(v[:n].clone(), a)

    def end_comm_round(self) -> None:
        if self._inflight is not None:   # before END goes out on the same channel (the round end's idle time)
            fut = self._settle_inflight()
            self.wait(future_done(fut), [0], "waiting for the centre holder's reply", False)
            self.pulled = fut.result()
        super().end_comm_round()

    def leave(self, timeout_s: Optional[float]) -> None:
        if self._inflight is not None:
            try:
                self._settle_inflight().result(timeout_s)
            except Exception:  # noqa: BLE001 - leaving after a failure: the first error is reported
                pass
        super().leave(timeout_s)

    def _round_due(self) -> bool:
        """Grouped time-mode rounds end at an exchange that any member's clock asked for."""
        if self.group is None or self.round_seconds is None:
            return super()._round_due()
        due, self._group_due = self._group_due, False
        return due

    def extra_evaluations(self) -> dict[str, list[torch.Tensor]]:
        """The centre is scored too (summary ``centre_test_accuracy``); the final model is the average."""
        return {"centre": self.centre_tensors()} if self.comm.world_size > 1 else {}


def build(params: EAWildParams, ctx: BuildContext) -> EAWild:
    return EAWild(ctx.model.parameters(), ctx.optimizer, ctx.comm, ctx.policy, tau=params.tau, alpha=params.alpha,
                  rho=params.rho, lock=params.lock, group_size=params.group_size,
                  compensate=params.compensate, round_steps=params.round_steps,
                  round_seconds=params.round_seconds, timeout_s=params.timeout_s)


SPECS = {"eawild": Spec(EAWildParams, build)}
