"""Typed configuration shared by every stage.

Each stage has a pydantic model (``extra="forbid"`` so a typo is an error, not a silent
default). A model is built from, in increasing priority:

1. the model's defaults,
2. a YAML file (``--config configs/X.yaml``),
3. ``--set dotted.key=value`` overrides (values parsed as YAML scalars/lists).

Stage-specific models live next to their stage (``pipeline/<stage>/...``) and subclass
:class:`StageConfig`; this module holds only the machinery and the shared pieces.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Type, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError

T = TypeVar("T", bound="StageConfig")


class SparkConfig(BaseModel):
    """How to reach Spark. ``master=None`` means: the master given by ``spark-submit``,
    else ``local[*]``. ``remote`` reaches Spark through Spark Connect instead (no SparkContext)."""

    model_config = ConfigDict(extra="forbid")
    master: Optional[str] = Field(None, description="Spark master URL; default: spark-submit's, else local[*]")
    remote: Optional[str] = Field(
        None, pattern=r"^(sc://\S+|local(\[(\*|\d+)(,\d+)?\])?)$",
        description="Spark Connect: the server's URL (sc://host:port), or local[N] to start a local Connect "
                    "server in this process; default: a classic session (docs/cluster.md#spark-connect)")
    app_name: str = Field("hep-pipeline", description="Spark application name")
    driver_memory: str = Field("4g", description="driver memory when Spark is started from Python")
    shuffle_partitions: int = Field(8, gt=0, description="spark.sql.shuffle.partitions")
    conf: dict[str, str] = Field(default_factory=dict, description="extra Spark settings")
    log_level: Literal["error", "warn", "info", "debug"] = Field(
        "warn", description="Spark's own log level; info brings its start-up lines back (as the verbose flag does)")


# ------------------------------------------------------------------------------------------
# How the user reaches a config key: the entry point decides the spelling of an error's hint
# ------------------------------------------------------------------------------------------
_COMMAND_LINE = {"on": False}


@contextmanager
def command_line() -> Iterator[None]:
    """Inside the block a job's command line (``pipeline.cli.run_job``) runs: hints name its options."""
    before, _COMMAND_LINE["on"] = _COMMAND_LINE["on"], True
    try:
        yield
    finally:
        _COMMAND_LINE["on"] = before


def entry_point() -> str:
    """How this process was started: ``airflow`` (a DAG task's spark-submit), ``spark-submit``,
    ``command line`` (``python -m jobs.X`` or ``python jobs/X.py``) or ``python`` (the API)."""
    if os.environ.get("AIRFLOW_CTX_DAG_ID"):
        return "airflow"
    if "PYSPARK_GATEWAY_PORT" in os.environ:   # set by spark-submit for the Python driver it starts
        return "spark-submit"
    return "command line" if _COMMAND_LINE["on"] else "python"


def option_hint(key: str, value: Any) -> str:
    """How to set config ``key`` to ``value`` from the entry point in use, for an error message:
    ``--master local[4]`` under spark-submit, ``--spark.master local[4]`` from ``python -m``, the
    DAG param under Airflow, ``SparkConfig(master='local[4]')`` from Python."""
    how = entry_point()
    if key == "spark.master":
        return {"airflow": f"the DAG param spark_master={value}", "spark-submit": f"--master {value}",
                "command line": f"--spark.master {value}"}.get(how, f"SparkConfig(master={value!r})")
    if how == "airflow":
        return f"the DAG param extra_sets {{<task>: [{key}={value}]}}"
    if how == "python":
        return f"{key}={value!r}"
    return f"--{key} {value}"


class StageConfig(BaseModel):
    """Base of every stage's config."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    spark: SparkConfig = Field(default_factory=SparkConfig)


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        nxt = cur.get(k)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[k] = nxt
        cur = nxt
    cur[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"bad --set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"bad --set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level")
    return data


_PRODUCER = re.compile(r"Input: ([^\s,(]+).*?written by `([^`]+)`")


def input_producer(path: str | os.PathLike | None) -> Optional[tuple[str, str]]:
    """(input path, the command that writes it) as a config file's leading comment says
    (``# Input: runs/hep/shards, written by `make run`.``); None when it says none."""
    if not path or not Path(path).is_file():
        return None
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            return None
        m = _PRODUCER.search(line)
        if m:
            return m.group(1), m.group(2)
    return None


def format_validation_error(err: ValidationError, cls: type) -> str:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "<root>"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        return f"unknown config key {loc!r} for {cls.__name__}"
    return f"invalid config value {loc}={first.get('input')!r}: {msg}"


def build_config(cls: Type[T], data: dict | None = None, overrides: list[str] | None = None) -> T:
    """Validate ``data`` (+ ``key=value`` overrides) into ``cls``; ConfigError on failure."""
    merged: dict = dict(data or {})
    for item in overrides or []:
        k, v = parse_override(item)
        _set_dotted(merged, k, v)
    try:
        return cls.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, cls)) from None


def load_config(cls: Type[T], path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> T:
    data = read_yaml(path) if path else {}
    return build_config(cls, data, overrides)


class _Required:
    """Marker default of a field that has none (``--help`` prints "required")."""

    def __repr__(self) -> str:
        return "required"


REQUIRED = _Required()


def config_fields(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, Any, str]]:
    """Flattened (dotted name, default, description) of every field, for ``--help``."""
    out = []
    for name, f in cls.model_fields.items():
        ann = f.annotation
        dotted = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(config_fields(ann, dotted + "."))
            continue
        default = REQUIRED if f.is_required() else f.get_default(call_default_factory=True)
        out.append((dotted, default, f.description or ""))
    return out
