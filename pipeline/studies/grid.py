"""A study's cells and the resolved run config of every cell x seed, checked before anything runs.

A cell is one combination of factor values: the product of the grid's values, crossed with the
named variants when both are given. Every cell's config is built from, in order: the workflow's
defaults, the ``base`` YAML, ``fixed``, the variant's ``set``, the grid values and the seed keys,
and validated with the workflow's pydantic model, so an unknown key or a bad value is one
:class:`~pipeline.errors.ConfigError` naming the factor, before any data is touched.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import _set_dotted, build_config, read_yaml
from ..errors import ConfigError, PipelineError
from ..workflows import HepRunConfig, ImagesRunConfig
from .spec import TARGET_METRICS, StudyConfig

RUN_CONFIGS = {"images": ImagesRunConfig, "hep": HepRunConfig}
VARIANT = "variant"


@dataclass(frozen=True)
class Cell:
    """One combination of factor values."""

    name: str                       # human label, e.g. "variant=slowmo, workers=4"
    factors: dict                   # factor column -> value (grid keys and "variant")
    overrides: dict                 # dotted key -> value applied on top of base + fixed
    key: str = field(default="")    # directory-safe id: slug + hash of the overrides

    def matches(self, sel: dict) -> bool:
        return all(k in self.factors and _same(self.factors[k], v) for k, v in sel.items())


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def factors_match(rec: dict, where: dict, any_of: Optional[dict] = None) -> bool:
    """Whether a run record's factors hold every ``where`` value and one of each ``any_of`` list."""
    f = rec.get("factors", {})
    return all(k in f and _same(f[k], v) for k, v in where.items()) and \
        all(k in f and any(_same(f[k], v) for v in vs) for k, vs in (any_of or {}).items())


def digest(obj: Any, n: int = 10) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text.replace("=", "-")).strip("_")[:60] or "cell"


def apply_overrides(data: dict, overrides: dict) -> dict:
    out = copy.deepcopy(data)
    for k, v in overrides.items():
        _set_dotted(out, k, copy.deepcopy(v))
    return out


def expand_cells(spec: StudyConfig) -> list[Cell]:
    """The study's cells in a stable order (variants outermost, then the grid's keys as written)."""
    f = spec.factors
    if not f.grid and not f.variants:
        raise ConfigError(f"study {spec.name}: empty factors (give factors.grid and/or factors.variants)")
    for k, vals in f.grid.items():
        if not vals:
            raise ConfigError(f"study {spec.name}: factors.grid.{k} is an empty list of values")
        if len({_fmt(v) for v in vals}) != len(vals):
            raise ConfigError(f"study {spec.name}: factors.grid.{k} repeats a value")
    names = [v.name for v in f.variants]
    if len(set(names)) != len(names):
        raise ConfigError(f"study {spec.name}: factors.variants repeats a name")
    for v in f.variants:
        both = sorted(set(v.set) & set(f.grid))
        if both:
            raise ConfigError(f"study {spec.name}: key {both[0]!r} is set by variant {v.name!r} and by the grid")
    keys = list(f.grid)
    variants = f.variants or [None]
    cells = []
    for var in variants:
        for combo in itertools.product(*(f.grid[k] for k in keys)):
            factors: dict = {}
            overrides: dict = {}
            label = []
            if var is not None:
                factors[VARIANT] = var.name
                overrides.update(var.set)
                label.append(var.name)
            for k, v in zip(keys, combo):
                factors[k] = v
                overrides[k] = v
                label.append(f"{k.rsplit('.', 1)[-1]}={_fmt(v)}")
            name = ", ".join(label)
            cells.append(Cell(name, factors, overrides, f"{_slug('_'.join(label))}-{digest(overrides, 6)}"))
    return cells


def find_baselines(spec: StudyConfig, cells: list[Cell]) -> dict[str, Cell]:
    """cell key -> the cell it is tested against. A name, or factor values matching one cell: that
    cell for every cell. Factor values matching several cells: each cell's baseline is the matched
    cell that shares its values of the other factors (a baseline per group)."""
    sel = spec.baseline
    if sel is None:
        return {c.key: cells[0] for c in cells}
    if isinstance(sel, str):
        hits = [c for c in cells if c.name == sel or (c.factors.get(VARIANT) == sel)]
    else:
        hits = [c for c in cells if c.matches(sel)]
    if len(hits) == 1:
        return {c.key: hits[0] for c in cells}
    if not hits or isinstance(sel, str):
        what = "is not a cell of the study" if not hits else f"matches {len(hits)} cells"
        raise ConfigError(f"study {spec.name}: baseline {_fmt(sel)} {what} (cells: {'; '.join(c.name for c in cells)})")
    out = {}
    for c in cells:
        rest = {k: v for k, v in c.factors.items() if k not in sel}
        mine = [b for b in hits if b.matches(rest)]
        if len(mine) != 1:
            raise ConfigError(f"study {spec.name}: baseline {_fmt(sel)} gives cell {c.name!r} "
                              f"{len(mine)} baselines with its other factor values (need exactly one)")
        out[c.key] = mine[0]
    return out


REPO = Path(__file__).resolve().parents[2]


def base_path(base: str) -> Path:
    """A relative ``base`` is looked up in the current directory, then in the repository."""
    p = Path(base)
    return p if p.is_absolute() or p.exists() or not (REPO / p).exists() else REPO / p


def base_data(base: Optional[str], fixed: dict) -> dict:
    """The ``base`` YAML (if any) with the ``fixed`` overrides applied."""
    data = read_yaml(base_path(base)) if base else {}
    return apply_overrides(data, fixed)


@dataclass
class StudyPlan:
    """Everything a study will run, resolved and validated."""

    spec: StudyConfig
    cells: list[Cell]
    baselines: dict                 # cell key -> the cell it is tested against
    seeds: list[int]
    base: dict                      # base YAML + fixed, as a dict
    configs: dict = field(default_factory=dict)   # (cell.key, seed) -> run config model

    @property
    def baseline_cells(self) -> list[Cell]:
        """The distinct baseline cells, in cell order."""
        keys = {b.key for b in self.baselines.values()}
        return [c for c in self.cells if c.key in keys]

    def is_baseline(self, cell: Cell) -> bool:
        return self.baselines[cell.key].key == cell.key

    @property
    def runs(self) -> list[tuple[Cell, int]]:
        return [(c, s) for c in self.cells for s in self.seeds]

    def config(self, cell: Cell, seed: int):
        return self.configs[(cell.key, seed)]


def build_run_config(cls, data: dict, where: str):
    """``cls`` (a workflow's run config) from ``data``; a bad key or value is a ConfigError prefixed by ``where``."""
    try:
        return build_config(cls, data)
    except PipelineError as e:
        raise ConfigError(f"{where}: {e}") from None


def resolve_run(spec: StudyConfig, base: dict, cell: Cell, seed: int, where: Optional[str] = None):
    """The workflow run config of one cell and seed (ConfigError naming the cell on bad input)."""
    cls = RUN_CONFIGS[spec.workflow]
    seeds = {k: seed for k in spec.seed_keys}
    cfg = build_run_config(cls, apply_overrides(base, {**cell.overrides, **seeds}),
                 where or f"study {spec.name}: cell {cell.name!r} seed {seed}")
    shard = cfg.shard.model_copy(update={"workers": cfg.workers})
    try:
        shard.layout()  # impossible layouts (H not dividing M, ...) before anything starts
    except PipelineError as e:
        raise ConfigError(f"study {spec.name}: cell {cell.name!r}: {e}") from None
    return cfg


def plan_study(spec: StudyConfig) -> StudyPlan:
    """Expand and validate the whole study (its tiny version when ``spec.tiny``); raises ConfigError
    naming the first bad item."""
    tiny = spec.tiny
    if tiny:
        from .tiny import in_one_process, shrink

        spec = shrink(spec)
    cls = RUN_CONFIGS[spec.workflow]
    base = base_data(spec.base, spec.fixed)
    build_run_config(cls, base, f"study {spec.name}: base {spec.base or '(defaults)'} + fixed")
    for k in spec.seed_keys:
        build_run_config(cls, apply_overrides(base, {k: 0}), f"study {spec.name}: seed_keys {k!r}")
    for k, vals in spec.factors.grid.items():  # each factor value alone: the error names the factor
        for v in vals:
            build_run_config(cls, apply_overrides(base, {k: v}), f"study {spec.name}: factor {k}={_fmt(v)}")
    for var in spec.factors.variants:
        build_run_config(cls, apply_overrides(base, var.set), f"study {spec.name}: variant {var.name!r}")
    if spec.target_accuracy is None:
        need = [m for m in spec.metrics if m in TARGET_METRICS]
        if need:
            raise ConfigError(f"study {spec.name}: metric {need[0]!r} needs target_accuracy")
    cells = expand_cells(spec)
    plan = StudyPlan(spec, cells, find_baselines(spec, cells), spec.seed_list(), base)
    for cell, seed in plan.runs:
        cfg = resolve_run(spec, base, cell, seed)
        plan.configs[(cell.key, seed)] = cfg = in_one_process(cfg) if tiny else cfg
        if spec.parallel_runs > 1 and cfg.train.launcher != "inprocess":
            raise ConfigError(f"study {spec.name}: parallel_runs={spec.parallel_runs} needs launcher inprocess; "
                              f"cell {cell.name!r} trains with launcher {cfg.train.launcher!r}")
    return plan
