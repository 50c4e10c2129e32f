"""Hierarchical local SGD on nested groups: households within neighbourhoods within the world.

Periods L_H < L_N < L_W (in steps). After step n, only the LARGEST group whose period divides
n averages its parameters (world if L_W | n, else the neighbourhood if L_N | n, else the
household if L_H | n, else nobody). Averaging goes through ``ModelAverager`` (BatchNorm and
momentum policy).

Groups come from the shard manifest (``workers[i]["group"] = {"household": h,
"neighbourhood": k}``) or, when the manifest has none, from ``household_size`` and
``neighbourhood_size`` (contiguous ranks). Households must nest inside neighbourhoods.
Every rank creates every group in the same order (group creation is a world collective).
``history`` records (step, level, ranks) of each averaging this rank took part in.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import BuildContext, Spec
from .averaging import ModelAverager
from .base import Algorithm


def groups_from_sizes(world: int, household_size: int, neighbourhood_size: int) -> list[dict]:
    if world % household_size or world % neighbourhood_size or neighbourhood_size % household_size:
        raise ValueError(f"household_size={household_size} and neighbourhood_size={neighbourhood_size} "
                         f"must nest and divide the {world} workers")
    return [{"household": r // household_size, "neighbourhood": r // neighbourhood_size} for r in range(world)]


class HierarchicalSGD(Algorithm):
    name = "hierarchical"

    def __init__(self, params, optimizer, comm, averager: ModelAverager, periods: tuple[int, int, int],
                 groups: list[dict]):
        super().__init__(params, optimizer, comm)
        self.averager = averager
        self.l_h, self.l_n, self.l_w = periods
        if len(groups) != comm.world_size:
            raise ValueError(f"need a group entry for each of the {comm.world_size} workers, got {len(groups)}")
        households: dict[int, list[int]] = {}
        hoods: dict[int, list[int]] = {}
        for r, g in enumerate(groups):
            households.setdefault(int(g["household"]), []).append(r)
            hoods.setdefault(int(g["neighbourhood"]), []).append(r)
        for h, ranks in households.items():
            if len({int(groups[r]["neighbourhood"]) for r in ranks}) != 1:
                raise ValueError(f"household {h} spans several neighbourhoods")
        # world collectives, same order on every rank
        self.household_groups = {h: comm.new_group(r) for h, r in sorted(households.items())}
        self.neighbourhood_groups = {k: comm.new_group(r) for k, r in sorted(hoods.items())}
        me = groups[comm.rank]
        self.household = self.household_groups[int(me["household"])]
        self.neighbourhood = self.neighbourhood_groups[int(me["neighbourhood"])]
        self.history: list[tuple[int, str, tuple[int, ...]]] = []
        self._last_level: Optional[str] = None

    def level_at(self, n: int) -> Optional[str]:
        if n % self.l_w == 0:
            return "world"
        if n % self.l_n == 0:
            return "neighbourhood"
        if n % self.l_h == 0:
            return "household"
        return None

    def after_step(self) -> None:
        n = self.step_count + 1
        level = self.level_at(n)
        self._last_level = level
        if level is None:
            return
        group = {"world": None, "neighbourhood": self.neighbourhood, "household": self.household}[level]
        self.averager.average_(group)
        ranks = tuple(range(self.comm.world_size)) if group is None else group.ranks
        self.history.append((n, level, ranks))

    def in_sync(self) -> bool:
        return self.level_at(self.step_count) == "world" if self.step_count else True


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    household_period: int = Field(2, ge=1, description="L_H")
    neighbourhood_period: int = Field(4, ge=1, description="L_N")
    world_period: int = Field(8, ge=1, description="L_W")
    household_size: Optional[int] = Field(None, ge=1, description="workers per household (if the manifest has no groups)")
    neighbourhood_size: Optional[int] = Field(None, ge=1, description="workers per neighbourhood (idem)")

    @model_validator(mode="after")
    def _ordered(self):
        if not (self.household_period < self.neighbourhood_period < self.world_period):
            raise ValueError(f"periods must satisfy L_H < L_N < L_W, got {self.household_period}, "
                             f"{self.neighbourhood_period}, {self.world_period}")
        return self

    def time_round_steps(self) -> None:
        """None: its steps do not depend on time (``algorithms.time_round_steps``)."""
        return None


def build(params: Params, ctx: BuildContext) -> HierarchicalSGD:
    world = ctx.comm.world_size
    groups = ctx.groups if ctx.groups and all(g for g in ctx.groups) else []
    if params.household_size or params.neighbourhood_size or not groups:
        hs = params.household_size or 1
        ns = params.neighbourhood_size or world
        groups = groups_from_sizes(world, hs, ns)
    return HierarchicalSGD(ctx.model.parameters(), ctx.optimizer, ctx.comm, ctx.policy,
                           (params.household_period, params.neighbourhood_period, params.world_period), groups)


SPECS = {"hierarchical": Spec(Params, build)}
