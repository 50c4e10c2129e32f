"""Training algorithms: each a small class wrapping any torch optimizer (see base.Algorithm).

Registry
--------
``REGISTRY`` maps an algorithm name (``TrainConfig.algorithm.name``) to the module that
implements it. Each such module exposes ``SPECS = {name: Spec(Params, build)}`` where
``Params`` is a pydantic model of the algorithm's parameters (``extra="forbid"``) and
``build(params, ctx) -> Algorithm``. Adding an algorithm = one new file + one line here.

``BuildContext`` carries what builders may need: the model, base optimizer, communicator,
the averaging policy (BatchNorm buffers / momentum), the manifest's per-worker groups and the
run seed (``TrainConfig.seed``; e.g. SwarmSGD's matchings and geometric draws).

This module imports no torch, so the config layer can list the registry cheaply.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from pydantic import BaseModel, ValidationError

from ...errors import ConfigError

if TYPE_CHECKING:
    from .base import Algorithm

REGISTRY: dict[str, str] = {
    "arsgd": "pipeline.train.algorithms.arsgd",
    "local_sgd": "pipeline.train.algorithms.local_sgd",
    "post_local_sgd": "pipeline.train.algorithms.local_sgd",
    "hierarchical": "pipeline.train.algorithms.hierarchical",
    "slowmo": "pipeline.train.algorithms.slowmo",
    "swarm": "pipeline.train.algorithms.swarm",
    "dpsgd": "pipeline.train.algorithms.dpsgd",
    "easgd": "pipeline.train.algorithms.easgd",
    "timed_local_sgd": "pipeline.train.algorithms.timed_local_sgd",
    "adpsgd": "pipeline.train.algorithms.adpsgd",
    "eawild": "pipeline.train.algorithms.eawild",
    "async_ps": "pipeline.train.algorithms.async_ps",
}


@dataclass
class Spec:
    params: type[BaseModel]
    build: Callable[[Any, "BuildContext"], "Algorithm"]


@dataclass
class BuildContext:
    model: Any
    optimizer: Any
    comm: Any
    policy: Any = None              # pipeline.train.algorithms.averaging.ModelAverager
    groups: list[dict] = field(default_factory=list)  # manifest workers[i]["group"], by rank
    seed: int = 0                   # the run seed (TrainConfig.seed)


def spec(name: str) -> Spec:
    if name not in REGISTRY:
        raise ConfigError(f"invalid config value algorithm.name={name!r}: known are {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name]).SPECS[name]


def validate_params(name: str, params: dict) -> BaseModel:
    s = spec(name)
    try:
        return s.params.model_validate(params or {})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        if first["type"] == "extra_forbidden":
            raise ConfigError(f"unknown config key algorithm.params.{loc} for algorithm {name!r}") from None
        raise ConfigError(f"invalid config value algorithm.params.{loc}={first.get('input')!r}: {first['msg']}") from None


def time_round_steps(name: str, params: Optional[dict]) -> Optional[int]:
    """Whether the steps of algorithm ``name`` depend on time (an asynchronous algorithm, time-budgeted
    rounds: the inprocess launcher runs it under the simulated clock), as its ``Params`` class declares
    with ``time_round_steps()``: None when they do not, else the steps a round of ``round_seconds`` is
    meant to hold (0: no such round). An algorithm whose ``Params`` do not declare it is refused in one
    line, so none runs off the simulated clock by omission."""
    p = validate_params(name, params or {})
    declared = getattr(p, "time_round_steps", None)
    if declared is None:
        raise ConfigError(f"algorithm {name!r}: its Params ({type(p).__name__}) do not declare time_round_steps(), "
                          "so the inprocess launcher cannot tell whether its steps depend on time")
    return declared()


def names() -> list[str]:
    """Every registered algorithm name, sorted."""
    return sorted(REGISTRY)


def build_algorithm(name: str, params: dict, ctx: BuildContext) -> "Algorithm":
    return spec(name).build(validate_params(name, params), ctx)
