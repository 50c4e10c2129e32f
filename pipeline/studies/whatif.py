"""Which algorithm, how many workers, on this cluster (``jobs/whatif.py``): a training config's model
and data run under the simulated clock of the cluster cost model (:mod:`pipeline.train.comm.costmodel`)
for every algorithm and worker count asked for, and the time to a target accuracy and its cost are
compared in one table and one plot.

Per cell (algorithm A, M workers):

* **Data:** the training rows of the config's manifest (a layout with one copy of each sample),
  dealt to M workers in disjoint blocks of a permutation seeded by the config's ``seed`` (the
  shard stage's ``disjoint`` scheme, written with pyarrow in a scratch folder); the evaluation
  splits are the manifest's own.
* **Cluster:** ``cluster`` (a preset name, or a YAML file of the training config's ``cluster``
  fields) with ``ranks_per_node`` ranks on each node: M workers take ``ceil(M / ranks_per_node)``
  nodes (the worker count sets the nodes; a YAML file that sets ``nodes`` is refused).
* **Run:** the config with ``launcher: inprocess``, the algorithm (its parameters from
  ``name:key=value:...``, else the config's own when it names the same algorithm), a step budget
  ``max_steps`` (it, not the config's epochs, ends the run) and a validation every ``eval_every``
  steps, under the clock.
* **Time to target:** the virtual time (``virtual_s`` of the validation record) of the first
  validation whose accuracy is at least ``target``; none when the budget ends first.
* **Cost:** node-hours to the target (nodes x virtual hours), times ``price_per_node_hour``.

Nothing of a cell's run is kept but its row: the table (``table.csv``, ``table.json``) and the plot
(``whatif.png``) are one committed output (:func:`pipeline.outputs.atomic_output_dir`).
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import Field, field_validator, model_validator

from ..config import StageConfig, load_config, read_yaml
from ..errors import BadInputError, ConfigError

log = logging.getLogger(__name__)

#: the columns of the table, in order (table.csv; table.json's rows carry the same keys)
COLUMNS = ("algorithm", "workers", "nodes", "steps", "virtual_s", "reached", "step_to_target", "time_to_target_s",
           "samples_per_s", "comm_share", "inter_node_bytes", "node_hours", "cost", "final_val_accuracy",
           "bytes_per_link")


class WhatIfConfig(StageConfig):
    """Configuration of ``jobs/whatif.py`` (:func:`whatif`)."""

    train_config: str = Field(description="training config (YAML): model, data (its manifest), optimizer, seed")
    cluster: str = Field(description="a cluster preset (gbe1 | gbe10 | ib100 | nvlink) or a YAML file of the "
                                     "training config's cluster fields (without nodes: the worker count sets them)")
    algorithms: list[str] = Field(description="algorithms to compare, comma-separated; parameters as "
                                              "name:key=value:key=value (e.g. local_sgd:period=8)")
    workers: list[int] = Field(description="worker counts M, comma-separated (e.g. 1,2,4,8)")
    target: float = Field(gt=0, le=1, description="target validation accuracy")
    ranks_per_node: int = Field(1, gt=0, description="ranks on each node (M workers take ceil(M / ranks_per_node) "
                                                     "nodes)")
    max_steps: int = Field(200, gt=0, description="step budget of each run")
    eval_every: Optional[int] = Field(None, gt=0, description="validate every N steps (default max_steps / 20)")
    price_per_node_hour: float = Field(1.0, gt=0, description="price of one node-hour (1: the cost is in node-hours)")
    currency: str = Field("node-hours", description="the unit of the cost column")
    output: str = Field(description="output folder: table.csv, table.json, whatif.png")

    @field_validator("algorithms", "workers", mode="before")
    @classmethod
    def _comma_list(cls, v):
        if isinstance(v, str):
            return [x.strip() for x in v.split(",") if x.strip()]
        if isinstance(v, int):
            return [v]
        return v

    @model_validator(mode="after")
    def _valid(self):
        if not self.algorithms:
            raise ConfigError("invalid config value algorithms=[]: name at least one algorithm")
        if not self.workers or any(m < 1 for m in self.workers):
            raise ConfigError(f"invalid config value workers={self.workers}: worker counts >= 1")
        for a in self.algorithms:
            parse_algorithm(a)
        cluster_fields(self.cluster, self.ranks_per_node)
        return self


def parse_algorithm(text: str) -> dict:
    """``name`` or ``name:key=value:key=value`` -> ``{"name": ..., "params": {...}}`` (values read as YAML)."""
    from ..train.algorithms import REGISTRY

    name, *pairs = [p.strip() for p in str(text).split(":")]
    if name not in REGISTRY:
        raise ConfigError(f"invalid config value algorithms={text!r}: unknown algorithm {name!r} (one of "
                          f"{', '.join(sorted(REGISTRY))})")
    params: dict[str, Any] = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"invalid config value algorithms={text!r}: parameter {p!r} is not key=value")
        params[k.strip()] = yaml.safe_load(v)
    return {"name": name, "params": params}


def cluster_fields(cluster: str, ranks_per_node: int) -> dict:
    """The training config's ``cluster`` fields of a preset name or a YAML file (without ``nodes``)."""
    from ..train.comm.costmodel import PRESETS

    if cluster in PRESETS:
        fields: dict = {"preset": cluster}
    else:
        p = Path(cluster)
        if not p.is_file():
            raise BadInputError(f"cluster {cluster!r}: neither a preset ({', '.join(PRESETS)}) nor a YAML file")
        fields = read_yaml(p)      # one line for a file that is not YAML or not a mapping
        fields = fields.get("cluster", fields) if isinstance(fields.get("cluster"), dict) else fields
        if "nodes" in fields:
            raise ConfigError(f"{cluster}: cluster.nodes={fields['nodes']}: set by the worker count here "
                              "(ceil(M / ranks_per_node)); give ranks_per_node instead")
    fields["ranks_per_node"] = ranks_per_node
    from ..train.config import ClusterConfig

    ClusterConfig(**{**fields, "nodes": 1})    # a bad field: one line now, before any run
    return fields


def nodes_for(workers: int, ranks_per_node: int) -> int:
    return -(-int(workers) // int(ranks_per_node))


def reshard(manifest_path: str, workers: int, seed: int, out: Path) -> str:
    """The manifest's training rows dealt to ``workers`` disjoint shards under ``out`` (see the
    module docstring); returns the new manifest's path."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..shards.manifest import ShardManifest, load_manifest
    from ..shards.schemes import layout_from_manifest, worker_seeds

    man = load_manifest(manifest_path)
    if man.copies != 1:
        raise BadInputError(f"{manifest_path}: layout {man.layout.scheme} holds {man.copies} copies of each sample; "
                            "the what-if study deals one copy to its workers (shard with scheme disjoint)")
    parts = []
    for w in man.workers:
        if "://" in w.path:
            raise BadInputError(f"{manifest_path}: worker {w.worker}'s shard {w.path} is not local")
        parts.extend(pq.read_table(Path(w.path) / f) for f in (w.files or sorted(p.name for p in
                                                                                Path(w.path).glob("*.parquet"))))
    table = pa.concat_tables(parts)
    if workers > table.num_rows:
        raise ConfigError(f"invalid config value workers={workers}: more workers than the {table.num_rows} training "
                          f"rows of {manifest_path}")
    order = np.random.default_rng([int(seed) & 0xFFFFFFFF, workers]).permutation(table.num_rows)
    layout = {"scheme": "disjoint", "workers": workers, "copies": 1, "seed": int(seed) & 0x7FFFFFFF}
    seeds = worker_seeds(layout_from_manifest(layout))
    entries = []
    for w, idx in enumerate(np.array_split(order, workers)):
        d = out / f"worker_{w:03d}"
        d.mkdir(parents=True)
        pq.write_table(table.take(pa.array(np.sort(idx))), d / "part-00000.parquet", row_group_size=man.row_group_rows)
        entries.append({"worker": w, "path": str(d.resolve()), "files": ["part-00000.parquet"], "rows": int(len(idx)),
                        "seed": seeds[w], "group": {}})
    path = out / "manifest.json"
    ShardManifest(source=man.source, layout=layout, n_train_samples=int(table.num_rows),
                  row_group_rows=man.row_group_rows, eval=man.eval, tensors=man.tensors, workers=entries).write(path)
    return str(path)


def time_to_target(records: list[dict], target: float, split: str = "val") -> tuple[Optional[int], Optional[float]]:
    """(step, virtual seconds) of the first ``split`` validation with accuracy >= target, else (None, None)."""
    for r in records:
        if r.get("kind") == "eval" and r.get("split") == split and r.get("accuracy") is not None \
                and not math.isnan(float(r["accuracy"])) and float(r["accuracy"]) >= target - 1e-12:
            return int(r["step"]), float(r["virtual_s"])
    return None, None


def _run_config(cfg: WhatIfConfig, train_cfg, algorithm: dict, workers: int, manifest: str, out: Path):
    from ..train.config import TrainConfig

    params = algorithm["params"] or (dict(train_cfg.algorithm.params) if train_cfg.algorithm.name == algorithm["name"]
                                     else {})
    # the training config's own compute profile stays unless the cluster gives one; its links do not
    own = train_cfg.cluster.model_dump(include={"compute_step_s", "compute_source"}, exclude_none=True)
    cluster = {**own, **cluster_fields(cfg.cluster, cfg.ranks_per_node),
               "nodes": nodes_for(workers, cfg.ranks_per_node)}
    data = train_cfg.model_dump(mode="json")
    data.update(manifest=manifest, output=str(out / "train"), checkpoint_dir=str(out / "ckpt"), launcher="inprocess",
                workers=workers, max_steps=cfg.max_steps, epochs=max(train_cfg.epochs, cfg.max_steps),
                eval_every=cfg.eval_every or max(1, cfg.max_steps // 20),
                eval_split="val", progress=False, tensorboard=False, checkpoint_every=0, resume=False,
                algorithm={"name": algorithm["name"], "params": params}, cluster=cluster)
    data["tracking"] = {**data.get("tracking", {}), "enabled": False}
    return TrainConfig.model_validate(data)


def run_cell(cfg: WhatIfConfig, train_cfg, algorithm: dict, workers: int, scratch: Path) -> dict:
    """One (algorithm, M) run under the clock and its row of the table."""
    from ..train.launch import train

    cell = scratch / f"{algorithm['name']}_M{workers}"
    manifest = reshard(train_cfg.manifest, workers, train_cfg.seed, cell / "shards")
    tc = _run_config(cfg, train_cfg, algorithm, workers, manifest, cell)
    result = train(tc)
    records = [json.loads(x) for x in (cell / "train" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    clock = result["ranks"][0]["simulated_clock"]
    step, t_target = time_to_target(records, cfg.target)
    nodes = nodes_for(workers, cfg.ranks_per_node)
    vals = [r for r in records if r.get("kind") == "eval" and r.get("split") == "val"]
    virtual_s = float(clock["virtual_s"])
    links = {k: float(v) for k, v in sorted(clock["bytes_per_link"].items())}
    node_hours = nodes * t_target / 3600.0 if t_target is not None else None
    return {"algorithm": tc.algorithm.name if not algorithm["params"] else
            f"{tc.algorithm.name}:" + ":".join(f"{k}={v}" for k, v in algorithm["params"].items()),
            "workers": workers, "nodes": nodes, "steps": int(result["steps"]), "virtual_s": virtual_s,
            "reached": step is not None, "step_to_target": step, "time_to_target_s": t_target,
            "samples_per_s": (result["samples_processed"] / virtual_s) if virtual_s > 0 else None,
            "comm_share": float(clock["comm_share"]),
            "inter_node_bytes": sum(v for k, v in links.items() if "->" in k),
            "node_hours": node_hours,
            "cost": node_hours * cfg.price_per_node_hour if node_hours is not None else None,
            "final_val_accuracy": float(vals[-1]["accuracy"]) if vals else None,
            "bytes_per_link": links}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def text_table(rows: list[dict], cfg: WhatIfConfig) -> str:
    """The table printed to stdout: one line per cell, then the answer (the fastest and the cheapest
    cell to the target)."""
    cols = [("algorithm", "algorithm"), ("workers", "M"), ("nodes", "nodes"), ("steps", "steps"),
            ("time_to_target_s", "time to target (s)"), ("step_to_target", "at step"),
            ("samples_per_s", "samples/s"), ("comm_share", "comm share"), ("inter_node_bytes", "inter-node bytes"),
            ("cost", f"cost ({cfg.currency})"), ("final_val_accuracy", "final val acc")]
    cells = [[h for _, h in cols]] + [[_fmt(r[k]) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(cols))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    reached = [r for r in rows if r["reached"]]
    if reached:
        fast = min(reached, key=lambda r: (r["time_to_target_s"], r["workers"]))
        cheap = min(reached, key=lambda r: (r["cost"], r["time_to_target_s"]))
        lines.append(f"fastest to {cfg.target:g}: {fast['algorithm']} on {fast['workers']} workers "
                     f"({_fmt(fast['time_to_target_s'])} s); cheapest: {cheap['algorithm']} on {cheap['workers']} "
                     f"workers ({_fmt(cheap['cost'])} {cfg.currency})")
    else:
        lines.append(f"no cell reached {cfg.target:g} within {cfg.max_steps} steps")
    return "\n".join(lines)


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (json.dumps(r[k], sort_keys=True) if isinstance(r[k], dict) else
                        ("" if r[k] is None else r[k])) for k in COLUMNS})
    return buf.getvalue()


def plan_whatif(cfg: WhatIfConfig) -> dict:
    return {"train_config": cfg.train_config, "cluster": cluster_fields(cfg.cluster, cfg.ranks_per_node),
            "cells": [{"algorithm": a, "workers": m, "nodes": nodes_for(m, cfg.ranks_per_node)}
                      for a in cfg.algorithms for m in cfg.workers],
            "outputs": [str(Path(cfg.output) / n) for n in ("table.csv", "table.json", "whatif.png")]}


def whatif(cfg: WhatIfConfig) -> dict:
    """Run every (algorithm, M) cell under the clock; print the table; write table.csv, table.json and
    whatif.png to ``cfg.output`` as one committed output. Returns the table."""
    from ..outputs import atomic_output_dir
    from ..report.whatif_figure import draw
    from ..train.config import TrainConfig

    if not Path(cfg.train_config).is_file():
        raise BadInputError(f"training config not found: {cfg.train_config}")
    train_cfg = load_config(TrainConfig, cfg.train_config)
    algorithms = [parse_algorithm(a) for a in cfg.algorithms]
    cluster = cluster_fields(cfg.cluster, cfg.ranks_per_node)
    for a in algorithms:       # every cell's config checked before the first run
        for m in cfg.workers:
            _run_config(cfg, train_cfg, a, m, train_cfg.manifest, Path(tempfile.gettempdir()))
    _check_sizes(cfg, train_cfg)
    rows: list[dict] = []
    n = len(algorithms) * len(cfg.workers)
    with tempfile.TemporaryDirectory(prefix="whatif-") as scratch:
        for a in algorithms:
            for m in cfg.workers:
                row = run_cell(cfg, train_cfg, a, m, Path(scratch))
                rows.append(row)
                print(f"whatif [{len(rows)}/{n}] {row['algorithm']} M={m}: {row['steps']} steps in "
                      f"{row['virtual_s']:.4g} virtual s, " + (
                          f"target {cfg.target:g} at step {row['step_to_target']} ({row['time_to_target_s']:.4g} s)"
                          if row["reached"] else f"target {cfg.target:g} not reached")
                      + f", comm share {row['comm_share']:.2f}", file=sys.stderr, flush=True)
    table = {"train_config": cfg.train_config, "cluster": cfg.cluster, "cluster_fields": cluster,
             "target": cfg.target, "max_steps": cfg.max_steps, "price_per_node_hour": cfg.price_per_node_hour,
             "currency": cfg.currency, "compute": _compute_source(train_cfg, cluster), "rows": rows}
    print(text_table(rows, cfg), flush=True)
    with atomic_output_dir(cfg.output) as d:
        (d / "table.csv").write_text(_csv(rows))
        (d / "table.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        draw(table, d / "whatif.png")
    return {**table, "output": cfg.output}


def _check_sizes(cfg: WhatIfConfig, train_cfg) -> None:
    """Each worker count's shard holds at least one worker batch (one line before any run)."""
    from ..shards.manifest import load_manifest

    n = load_manifest(train_cfg.manifest).n_train_samples
    for m in cfg.workers:
        b = train_cfg.batch_size // m if train_cfg.batch_rule == "global" else train_cfg.batch_size
        if train_cfg.batch_rule != "household" and n // m < b:
            raise ConfigError(f"invalid config value workers={m}: {n} training rows of {train_cfg.manifest} give each "
                              f"of {m} workers {n // m} rows, fewer than its batch of {b}")


def _compute_source(train_cfg, cluster: dict) -> str:
    """Where a step's compute time comes from (the clock's order: ``simulated_clock.step_s``, the
    cluster's profile, the clock's default)."""
    if train_cfg.simulated_clock.step_s is not None:
        return f"simulated_clock.step_s={train_cfg.simulated_clock.step_s:g} s of the training config"
    if cluster.get("compute_step_s") is not None:
        return f"compute_step_s {cluster['compute_step_s']} ({cluster.get('compute_source')})"
    if train_cfg.cluster.compute_step_s is not None:
        return f"compute_step_s {train_cfg.cluster.compute_step_s} ({train_cfg.cluster.compute_source})"
    return "the clock's default step (0.01 s): no compute profile given"

