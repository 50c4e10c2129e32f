"""What a study's run costs on the local launcher (one process per worker) and on the in-process
launcher (the workers as ranks of one process), at M = 16 on Fashion-MNIST with H&B's protocol.

Four measurements; ``runs`` and ``batch`` are ratios against the local launcher measured in the same run,
``start`` and ``start-issue`` a fixed cost of this code or, with ``--repo``, another checkout's:

* ``runs``: one E1-protocol run (e1_workers, M = 16, LeNet-5 with BatchNorm) and one E3.2.4 run
  (e3_2_4_household_overlap, L_W = 32, S_H = 8), ``--steps`` steps each with the protocol's
  validation: wall time of the training stage, steps/s of the training loop, and the ratio;
* ``batch``: ten E3.2.4 runs (the study's runs of L_W = 32 with S_H = 8 and 2, seeds 0-4, ``--steps``
  each), the way a study runs them: one after another on each launcher, and two at once on the
  in-process one (``parallel_runs: 2``); total wall time on each launcher and the ratios (target: at least 5x);
  with ``--issue-repo <checkout>`` also on the local launcher of that checkout's code (the code at the
  studies issue's time, the baseline its target was set on), in a child process, on the same data;
* ``start``: the fixed cost of a real M = 16 run on the local launcher (E1 protocol with plain
  LeNet-5, so that older code runs it too, 10 steps): the
  training stage's wall time less its training loop (process starts, plan, the final test
  evaluation), ``--repeat`` times; with ``--repo`` another checkout's code is measured (the
  baseline of a change: run it once with the old checkout and once with the new one);
* ``start-issue``: the same fixed cost measured as the studies issue measured it:
  ``configs/run_images_haland.yaml`` (M = 16) on the local launcher with ``train.max_steps=300``,
  on data the image workflow makes once in ``--issue-data`` (so that an older checkout, ``--repo``,
  trains on the same shards as this one).

The data (Fashion-MNIST ingested and sharded as the studies do) comes from the studies' cache
(``--data``, default runs/studies/data) and is made there once if missing (Spark). Run it alone on
an idle machine; it prints the load average beside every figure.

    .venv/bin/python bench/study_cost.py [--only runs,batch,start,start-issue] [--steps 100] [--repeat 3]
        [--issue-data DIR] [--repo CHECKOUT] [--issue-repo CHECKOUT]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def run_config(study: str, select: dict, seed: int, data: Path, launcher: str, steps: int, out: Path,
               fixed: dict | None = None):
    """The train config of one run of a shipped study (its data made once), with the launcher and
    the step budget set; ``fixed``: more overrides of every cell (keys the measured code may not know
    are left out, so an older checkout runs the same config)."""
    import yaml

    from pipeline.studies.grid import plan_study
    from pipeline.studies.spec import StudyConfig
    from pipeline.studies.runner import prepare_data, stage_configs

    doc = yaml.safe_load((HERE / "configs" / "experiments" / f"{study}.yaml").read_text())
    doc = {k: v for k, v in doc.items() if k in StudyConfig.model_fields}
    if "parallel_runs" in doc:     # one run's config (the batch's pool is the benchmark's own), any launcher
        doc["parallel_runs"] = 1
    doc["base"] = str(HERE / doc["base"])
    doc["fixed"] = {**doc.get("fixed", {}), **(fixed or {})}
    spec = StudyConfig.model_validate(doc)
    plan = plan_study(spec)
    cell = next(c for c in plan.cells if c.matches(select))
    cfg = plan.config(cell, seed)
    p = prepare_data(cfg, spec.workflow, data, spark_if_missing(cfg, spec.workflow, data))
    p["train"] = out
    t = stage_configs(cfg, spec.workflow, p)["train"]
    return t.model_copy(update={"launcher": launcher, "max_steps": steps, "progress": False,
                                "checkpoint_every": 0})


def spark_if_missing(cfg, workflow: str, data: Path):
    """A local Spark session when a dataset of this run is not in the cache yet, else None."""
    from pipeline.studies.runner import data_paths
    from pipeline.studies.workspace import is_complete

    if all(is_complete(out) for _, _, out in data_paths(cfg, workflow, data)[1]):
        return None
    from pipeline.config import SparkConfig
    from pipeline.spark import get_spark

    return get_spark(SparkConfig(master="local[2]"))


def one_run(cfg) -> dict:
    from pipeline.train.launch import train

    t0 = time.time()
    s = train(cfg)
    wall = time.time() - t0
    return {"wall": wall, "train": float(s["train_seconds"]), "steps": int(s["steps"]),
            "acc": float(s["test_accuracy"]), "fixed": wall - float(s["train_seconds"])}


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.1f} s (min {min(xs):.1f}, max {max(xs):.1f}, n {len(xs)})"


def bench_runs(data: Path, tmp: Path, steps: int) -> None:
    print(f"\n== one run at M = 16, {steps} steps ({load()})")
    print("| run | launcher | wall s | steps/s (training loop) | test accuracy | local / inprocess wall |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for label, study, sel in (("E1 protocol", "e1_workers", {"workers": 16}),
                              ("E3.2.4", "e3_2_4_household_overlap", {"variant": "LW32", "shard.household_shards": 8})):
        res = {}
        for launcher in ("local", "inprocess"):
            cfg = run_config(study, sel, 0, data, launcher, steps, tmp / f"{study}-{launcher}")
            res[launcher] = one_run(cfg)
        for launcher, r in res.items():
            ratio = f"{res['local']['wall'] / r['wall']:.2f}x" if launcher == "inprocess" else ""
            print(f"| {label} | {launcher} | {r['wall']:.1f} | {r['steps'] / r['train']:.1f} | {r['acc']:.4f} | "
                  f"{ratio} |", flush=True)
        print(f"({load()})")


#: the batch: the study's 10 runs of L_W = 32 with S_H = 8 and S_H = 2 (5 seeds each), in the study's order
BATCH = [({"variant": "LW32", "shard.household_shards": sh}, seed) for sh in (8, 2) for seed in range(5)]


def batch_configs(data: Path, tmp: Path, launcher: str, steps: int, name: str) -> list:
    """The batch's train configs (their data made first, outside the timings)."""
    return [run_config("e3_2_4_household_overlap", sel, seed, data, launcher, steps, tmp / f"{name}-{i}")
            for i, (sel, seed) in enumerate(BATCH)]


def one_after_another(cfgs: list, label: str) -> float:
    """The runs one after another; their total wall time (printed with the spread of a run's)."""
    walls = []
    t0 = time.time()
    for cfg in cfgs:
        walls.append(one_run(cfg)["wall"])
    total = time.time() - t0
    print(f"{label}: {total:.1f} s for {len(cfgs)} runs; per run {spread(walls)} ({load()})", flush=True)
    return total


#: the line with which the ``batch-local`` child reports its total to the run that started it
TOTAL = "batch-local-total"


def issue_batch(repo: str, cfgs: list, tmp: Path) -> float:
    """The batch's local runs (``cfgs``, made by this code on this code's data) with another checkout's
    code (the code at the issue's time), in a child process of this run: its total wall time. A field
    that code does not know is left out of the configs it reads."""
    import json
    import subprocess

    path = tmp / "issue-batch.json"
    path.write_text(json.dumps([c.model_dump(mode="json") for c in cfgs]))
    cmd = [sys.executable, __file__, "--only", "batch-local", "--configs", str(path), "--repo", repo]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    print(out, end="", flush=True)
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith(TOTAL)))


def batch_local(configs: Path) -> None:
    """The child of :func:`issue_batch`: the configs in ``configs`` one after another with the code of
    ``--repo``; the total on a line of its own."""
    import json

    from pipeline.train.config import TrainConfig

    cfgs = [known_fields(TrainConfig, d) for d in json.loads(configs.read_text())]
    print(f"{TOTAL} {one_after_another(cfgs, f'local ({code_root()})'):.3f}", flush=True)


def known_fields(model, doc: dict):
    """``model`` validated from ``doc`` less the fields (at any depth) that this code's model does not know."""
    from pydantic import ValidationError

    while True:
        try:
            return model.model_validate(doc)
        except ValidationError as e:
            extra = [err["loc"] for err in e.errors() if err["type"] == "extra_forbidden"]
            if not extra:
                raise
            for loc in extra:
                parent = doc
                for key in loc[:-1]:
                    parent = parent[key]
                del parent[loc[-1]]


def bench_batch(data: Path, tmp: Path, steps: int, issue_repo: str | None) -> None:
    """The batch on the local launcher and on the in-process one, one run after another, and on the
    in-process one two runs at once (``parallel_runs: 2``, pipeline/studies/parallel.py); with
    ``issue_repo`` also on the local launcher of that checkout (the baseline the target was set on), on
    the same data."""
    from pipeline.studies.parallel import RunPool

    print(f"\n== a batch of {len(BATCH)} E3.2.4 runs (L_W = 32, S_H = 8 and 2, seeds 0-4), {steps} steps each "
          f"({load()})")
    totals = {}
    local = batch_configs(data, tmp, "local", steps, "batch-local")
    if issue_repo:
        totals["issue"] = issue_batch(issue_repo, [c.model_copy(update={"output": str(tmp / f"batch-issue-{i}")})
                                                   for i, c in enumerate(local)], tmp)
    totals["local"] = one_after_another(local, "local")
    totals["inprocess"] = one_after_another(batch_configs(data, tmp, "inprocess", steps, "batch-inprocess"),
                                            "inprocess")
    cfgs = batch_configs(data, tmp, "inprocess", steps, "batch-two")
    t0 = time.time()
    pool = RunPool(2)
    try:
        accs = [f.result()[0]["test_accuracy"] for f in [pool.submit(c) for c in cfgs]]
    finally:
        pool.close()
    totals["two"] = time.time() - t0
    print(f"inprocess, 2 at once: {totals['two']:.1f} s for {len(BATCH)} runs, the pool's start included; test "
          f"accuracies {' '.join(f'{a:.4f}' for a in accs)} ({load()})", flush=True)
    bases = [("local", "local")] + ([("issue", f"local at {issue_repo}")] if issue_repo else [])
    for base, base_label in bases:
        for key, label in (("inprocess", "inprocess, one after another"), ("two", "inprocess, 2 at once")):
            print(f"batch of {len(BATCH)}: {base_label} / {label} = {totals[base] / totals[key]:.2f}x (target >= 5x)")


def bench_start(data: Path, tmp: Path, repeat: int) -> None:
    print(f"\n== the fixed cost of a real M = 16 run (local launcher, E1 protocol, 10 steps; code: {code_root()})")
    fixed_costs([run_config("e1_workers", {"workers": 16}, 0, data, "local", 10, tmp / f"start-{i}",
                            {"train.model": "lenet5"}) for i in range(repeat)])


def fixed_costs(cfgs: list) -> None:
    """Each run's training stage, its wall time less its training loop, and their spread."""
    fixed = []
    for i, cfg in enumerate(cfgs):
        r = one_run(cfg)
        fixed.append(r["fixed"])
        print(f"  run {i + 1}: stage {r['wall']:.1f} s, training loop {r['train']:.1f} s, fixed {r['fixed']:.1f} s "
              f"({load()})", flush=True)
    print(f"fixed cost: {spread(fixed)}")


def bench_start_issue(data: Path, tmp: Path, repeat: int) -> None:
    """The fixed cost as the issue measured it: ``configs/run_images_haland.yaml`` (M = 16, Fashion-MNIST)
    on the local launcher with ``train.max_steps=300``, the training stage's wall time less its training
    loop. The data (the image workflow's ingest and shards, Spark) is made in ``data`` once, by the
    code measured first; a later run, of this code or another checkout's, trains on the same shards."""
    import json

    from pipeline.config import load_config
    from pipeline.workflows import ImagesRunConfig, images_stage_configs, run_images

    root = Path(code_root())
    print(f"\n== the fixed cost of configs/run_images_haland.yaml (local launcher, 300 steps; code: {root})")
    cfg = load_config(ImagesRunConfig, root / "configs" / "run_images_haland.yaml",
                      [f"output_root={data}", "train.launcher=local", "train.max_steps=10", "train.progress=false"])
    made = data / "summary.json"
    outputs = json.loads(made.read_text())["outputs"] if made.exists() else run_images(cfg)["outputs"]
    stage = images_stage_configs(cfg, {k: Path(v) for k, v in outputs.items()})["train"]
    fixed_costs([stage.model_copy(update={"max_steps": 300, "output": str(tmp / f"haland-train-{i}")})
                 for i in range(repeat)])


def code_root() -> str:
    import pipeline

    return str(Path(pipeline.__file__).resolve().parents[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="runs,batch,start,start-issue",
                    help="comma-separated: runs, batch, start, start-issue (batch-local: the child that "
                         "--issue-repo starts, with --configs)")
    ap.add_argument("--steps", type=int, default=100, help="steps of each run in runs and batch (default 100)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of start (default 3)")
    ap.add_argument("--data", default=str(HERE / "runs" / "studies" / "data"), help="the studies' data cache")
    ap.add_argument("--issue-data", default=None, help="start-issue: where its data is made once and reused "
                                                       "(default: a temporary directory)")
    ap.add_argument("--repo", default=None, help="measure the pipeline code of this checkout instead")
    ap.add_argument("--issue-repo", default=None,
                    help="batch: also run the batch on the local launcher of this checkout (the code at the "
                         "issue's time), in a child process, on the same data")
    ap.add_argument("--configs", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(a.repo).resolve() if a.repo else HERE))
    import logging

    logging.basicConfig(level=logging.WARNING)
    only = set(a.only.split(","))
    print(f"study_cost: {os.cpu_count()} CPUs, {load()}, code {code_root()}")
    with tempfile.TemporaryDirectory(prefix="study-cost-") as d:
        tmp = Path(d)
        if "runs" in only:
            bench_runs(Path(a.data), tmp, a.steps)
        if "batch" in only:
            bench_batch(Path(a.data), tmp, a.steps, a.issue_repo)
        if "batch-local" in only:
            batch_local(Path(a.configs))
        if "start" in only:
            bench_start(Path(a.data), tmp, a.repeat)
        if "start-issue" in only:
            bench_start_issue(Path(a.issue_data) if a.issue_data else tmp / "haland", tmp, a.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
