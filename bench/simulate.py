"""Benchmark of the simulation stage: events/s per core of the Spark stage against a bare
single-process loop over the same generator, all measured in this run.

    .venv/bin/python bench/simulate.py [--events 300] [--cores 2] [--events-per-file 150]

Three measurements on the same config and seeds (ttbar, W+jets, QCD; lepton filter on):

1. bare loop: one process, one Pythia instance per (process, task) as in the stage, only
   ``ProcessGenerator.generate`` (Pythia + filter, no detector, no file);
2. in-process tasks: the stage's ``run_task`` (Pythia + detector model + ROOT writing) in a loop,
   no Spark;
3. Spark stage: ``generate(cfg)`` on ``local[cores]``, including Spark task scheduling, worker
   start-up and the driver's progress bookkeeping.

Printed: events/s (written events, after the filter), events/s per core and the ratios
(2)/(1) and (3 per core)/(1); and, because a shared machine's load moves wall-clock rates,
events per CPU-second of the working processes (bare loop / in-process tasks: this process's
CPU time; Spark: the sum of the tasks' CPU times recorded in simulation.json). Compare only
numbers from the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=300, help="events per process")
    ap.add_argument("--events-per-file", type=int, default=150)
    ap.add_argument("--cores", type=int, default=2, help="Spark local[N]")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pipeline.commit import JobTarget
    from pipeline.config import SparkConfig
    from pipeline.simulate import SimulateConfig
    from pipeline.simulate.generator import ProcessGenerator
    from pipeline.simulate.stage import generate, make_tasks, run_task, settings_for
    from pipeline.spark import get_spark

    tmp = tempfile.mkdtemp(prefix="bench-simulate-")
    cfg = SimulateConfig(events=args.events, events_per_file=args.events_per_file, seed=args.seed,
                         output=os.path.join(tmp, "spark"), progress=False,
                         spark=SparkConfig(master=f"local[{args.cores}]", app_name="bench-simulate"))
    tasks = make_tasks(cfg)
    n_total = sum(t["events"] for t in tasks)
    try:
        # 1. bare single-process generator loop
        t0, c0 = time.perf_counter(), time.process_time()
        for t in tasks:
            p = t["process"]
            g = ProcessGenerator(p, settings_for(cfg, p), t["pythia_seed"],
                                 filter_pt=cfg.lepton_filter.pt_min if p in cfg.lepton_filter.processes else None,
                                 filter_eta=cfg.lepton_filter.eta_max)
            g.generate(t["events"], cfg.batch_size)
        bare = n_total / (time.perf_counter() - t0)
        bare_cpu = n_total / (time.process_time() - c0)

        # 2. the stage's tasks in one process, no Spark
        t0, c0 = time.perf_counter(), time.process_time()
        for t in tasks:
            r = run_task(t, cfg, JobTarget(os.path.join(tmp, "inproc")))
            assert "error" not in r, r
        inproc = n_total / (time.perf_counter() - t0)
        inproc_cpu = n_total / (time.process_time() - c0)

        # 3. the Spark stage (session started before timing: its start-up is not the stage's)
        spark = get_spark(cfg.spark)
        spark.sparkContext.parallelize(range(args.cores), args.cores).map(lambda x: x).collect()  # warm workers
        t0 = time.perf_counter()
        res = generate(cfg, spark=spark)
        wall = time.perf_counter() - t0
        stage = sum(res["events"].values()) / wall
        side = json.loads(open(res["sidecar"]).read())
        task_cpu = sum(f["cpu_seconds"] for v in side["processes"].values() for f in v["files"])
        stage_cpu = sum(res["events"].values()) / task_cpu
        spark.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    out = {
        "events_per_process": args.events, "tasks": len(tasks), "cores": args.cores,
        "bare_loop_events_per_s": round(bare, 2),
        "inprocess_tasks_events_per_s": round(inproc, 2),
        "spark_stage_events_per_s": round(stage, 2),
        "spark_stage_events_per_s_per_core": round(stage / args.cores, 2),
        "ratio_inprocess_vs_bare": round(inproc / bare, 3),
        "ratio_spark_per_core_vs_bare": round(stage / args.cores / bare, 3),
        "cpu_time_rates": {   # events per CPU-second of the processes doing the work (load-independent)
            "bare_loop": round(bare_cpu, 2), "inprocess_tasks": round(inproc_cpu, 2),
            "spark_tasks": round(stage_cpu, 2),
            "ratio_spark_tasks_vs_bare": round(stage_cpu / bare_cpu, 3)},
        "filter_efficiency": {k: round(v, 4) for k, v in res["filter_efficiency"].items()},
        "load_average": os.getloadavg(),
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
