"""The simulation stage: split the work into tasks, run them on Spark, write atomically.

Work split: each process's ``events`` are cut into tasks of ``events_per_file`` events
(the last one smaller); task ``i`` of process ``p`` gets seeds ``derive_seeds(seed, p, i)`` and
writes exactly one ROOT file ``<output>/<p>/<p>_<i:04d>.root``. Tasks of different processes are
interleaved and each is one Spark partition, so the stage scales with executors and a task's
events do not depend on which executor ran it or how many ran beside it.

Driver: runs ``rdd.map(run_task).collect()`` in a background thread and shows a progress bar of
generated events, fed by a Spark accumulator that each finished task adds its events to. On a Spark
Connect session (no RDD, no accumulator) the tasks run through ``mapInArrow`` instead and the bar
moves when they are done.
Output (a local path, a shared mount or ``s3://``): each task writes its ROOT file into its
executor's scratch space (uproot writes a seekable local file) and copies it to the output's
filesystem under the job's prefix with an attempt-scoped name; the driver commits the files of the
attempts Spark returned (:mod:`pipeline.commit`), plus the sidecar ``simulation.json`` with the
generator settings, versions, seeds, per-file event counts, filter efficiencies and Pythia's
cross sections.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version

import numpy as np

from ..commit import JobTarget, output_job
from ..errors import BadInputError, ConfigError, PipelineError
from ..features.layout import CLASS_LABELS
from ..fs import location
from ..redact import redact
from ..spark import forward_s3_settings, get_spark, is_connect, spark_task, task_frame
from .config import SimulateConfig
from .delphes_io import write_delphes
from .detector import simulate_detector
from .generator import ProcessGenerator, derive_seeds, process_settings

log = logging.getLogger(__name__)
SIDECAR = "simulation.json"
FORMAT = "hep-pipeline-simulation/1"
CHUNK_EVENTS = 250          # events run through the detector model and written per ROOT basket


def settings_for(cfg: SimulateConfig, process: str) -> list[str]:
    """The full list of Pythia settings of ``process`` under ``cfg`` (seed lines excluded)."""
    return process_settings(process, ecm=cfg.ecm, qcd_pthat_min=cfg.qcd_pthat_min,
                            qcd_force_semileptonic=cfg.qcd_force_semileptonic,
                            wjets_pthat_min=cfg.wjets_pthat_min, extra=cfg.pythia.get(process))


def make_tasks(cfg: SimulateConfig) -> list[dict]:
    """All (process, task index, n events) tasks with their seeds and file names, interleaved by process."""
    per_process = []
    for p in cfg.processes:
        tasks, done, i = [], 0, 0
        while done < cfg.events:
            n = min(cfg.events_per_file, cfg.events - done)
            s_pythia, s_numpy = derive_seeds(cfg.seed, p, i)
            tasks.append({"process": p, "task": i, "events": n, "first_event": done,
                          "pythia_seed": s_pythia, "numpy_seed": s_numpy, "file": f"{p}/{p}_{i:04d}.root"})
            done += n
            i += 1
        per_process.append(tasks)
    out = []
    for k in range(max(len(t) for t in per_process)):
        out.extend(t[k] for t in per_process if k < len(t))
    return out


def run_task(task: dict, cfg: SimulateConfig, target: JobTarget) -> dict:
    """Generate one task's events, run the detector model and write its ROOT file (runs on an
    executor): into the executor's scratch space, then copied to ``task["file"]`` of this task
    attempt in the job (:meth:`~pipeline.commit.TaskAttempt.put_file`).

    Returns the task dict extended with ``attempts``, ``passed``, ``seconds``, ``cross_section_pb``
    and the attempt's record (``attempt_dir``, ``files``); a :class:`PipelineError` is returned as
    ``{"error": message}`` so the driver can report it in one line.
    """
    t0, c0 = time.time(), time.process_time()
    p = task["process"]
    try:
        filt = cfg.lepton_filter
        gen = ProcessGenerator(p, settings_for(cfg, p), task["pythia_seed"],
                               filter_pt=filt.pt_min if p in filt.processes else None, filter_eta=filt.eta_max)
        rng = np.random.default_rng(task["numpy_seed"])
        first_number = CLASS_LABELS[p] * 10**9 + task["first_event"]

        def chunks():
            done = 0
            while done < task["events"]:
                n = min(CHUNK_EVENTS, task["events"] - done)
                b = gen.generate(n, cfg.batch_size, max_attempts=cfg.max_attempts_factor * n)
                yield simulate_detector(b.prt, b.info, cfg.detector, rng, gen.charge_of,
                                        first_event_number=first_number + done, process_id=CLASS_LABELS[p])
                done += n

        scratch = tempfile.mkdtemp(prefix="pipeline-simulate-")
        try:
            local = os.path.join(scratch, os.path.basename(task["file"]))
            n_written = write_delphes(local, chunks())
            attempt = target.attempt()
            attempt.put_file(task["file"], local)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {**task, "events": n_written, "attempts": gen.attempts, "passed": gen.passed,
                "cross_section_pb": gen.cross_section_pb(), "seconds": round(time.time() - t0, 3),
                "cpu_seconds": round(time.process_time() - c0, 3), **attempt.record()}
    except PipelineError as e:
        return {**task, "error": str(e), "error_type": type(e).__name__}


def plan_generate(cfg: SimulateConfig) -> dict:
    """Inputs/outputs of a run, for ``--dry-run`` (starts no Spark, generates nothing)."""
    tasks = make_tasks(cfg)
    out = location(cfg.output, output=True)
    return {"inputs": [], "output": str(out), "sidecar": str(out.child(SIDECAR)),
            "tasks": len(tasks), "events_per_process": cfg.events,
            "files": {p: [str(out.child(t["file"])) for t in tasks if t["process"] == p] for p in cfg.processes},
            "pythia_settings": {p: settings_for(cfg, p) for p in cfg.processes}}


def _versions() -> dict:
    out = {}
    for pkg in ("pythia8mc", "fastjet", "uproot", "awkward", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _connect_tasks(batches, cfg: SimulateConfig, target: JobTarget):
    """``mapInArrow`` body: run this partition's tasks, one JSON result row each."""
    import pyarrow as pa

    for b in batches:
        for i, t in zip(b.column("index").to_pylist(), b.column("task").to_pylist()):
            r = run_task(json.loads(t), cfg, target)
            yield pa.RecordBatch.from_pylist([{"index": i, "result": json.dumps(r)}])


def _run_on_connect(spark, tasks: list[dict], cfg: SimulateConfig, target: JobTarget) -> list[dict]:
    """The tasks from a Spark Connect session: one partition each, results in task order."""
    fn = functools.partial(_connect_tasks, cfg=cfg, target=target)
    df = task_frame(spark, [(i, json.dumps(t)) for i, t in enumerate(tasks)], "index long, task string")
    rows = df.mapInArrow(spark_task(fn), "index long, result string").collect()
    results = [json.loads(r["result"]) for r in sorted(rows, key=lambda r: r["index"])]
    if cfg.progress:
        from ..progress import Bar

        bar = Bar(sum(t["events"] for t in tasks), "simulate", unit="ev")
        bar.update(sum(r.get("events", 0) for r in results if "error" not in r))
        bar.close()
    return results


def _run_on_spark(spark, tasks: list[dict], cfg: SimulateConfig, target: JobTarget) -> list[dict]:
    if is_connect(spark):
        return _run_on_connect(spark, tasks, cfg, target)
    sc = spark.sparkContext
    acc = sc.accumulator(0)

    def work(task):
        r = run_task(task, cfg, target)
        acc.add(r.get("events", 0) if "error" not in r else 0)
        return r

    box: dict = {}

    def collect():
        try:
            sc.setJobDescription(f"simulate {len(tasks)} tasks")
            box["results"] = sc.parallelize(tasks, len(tasks)).map(spark_task(work)).collect()
        except BaseException as e:  # noqa: BLE001 - re-raised on the driver thread
            box["error"] = e

    total = sum(t["events"] for t in tasks)
    from pyspark import InheritableThread

    # InheritableThread: the job runs with the caller's local properties (job group, pool, ...)
    th = InheritableThread(target=collect, name="simulate-collect", daemon=True)
    th.start()
    bar = None
    if cfg.progress:
        from ..progress import Bar   # a bar on a terminal, whole lines otherwise

        bar = Bar(total, "simulate", unit="ev")
    try:
        while th.is_alive():
            th.join(0.5)
            if bar is not None and acc.value > bar.n:
                bar.update(acc.value - bar.n)
        if bar is not None and acc.value > bar.n:
            bar.update(acc.value - bar.n)
    finally:
        if bar is not None:
            bar.close()
    if "error" in box:
        raise box["error"]
    return box["results"]


def generate(cfg: SimulateConfig, spark=None) -> dict:
    """Run the stage. Returns ``{"output", "sidecar", "files": {process: [paths]}, "events": {process: n},
    "filter_efficiency": {process: eff}, "seconds"}``; files are listed in task order."""
    t0 = time.time()
    tasks = make_tasks(cfg)
    spark = spark or get_spark(cfg.spark)
    final = location(cfg.output, output=True)
    log.info("simulate: %d events of %s in %d tasks -> %s", cfg.events, ", ".join(cfg.processes), len(tasks), final)
    if not final.is_local:
        forward_s3_settings(spark)
    with output_job(final, overwrite=cfg.overwrite) as job:
        results = _run_on_spark(spark, tasks, cfg, job.target)
        failed = [r for r in results if "error" in r]
        if failed:
            cls = {"ConfigError": ConfigError, "BadInputError": BadInputError}.get(failed[0]["error_type"],
                                                                                   PipelineError)
            raise cls(failed[0]["error"])
        job.add(results)
        procs = {}
        for p in cfg.processes:
            rs = [r for r in results if r["process"] == p]
            att, passed = sum(r["attempts"] for r in rs), sum(r["passed"] for r in rs)
            xs = [r["cross_section_pb"] for r in rs]
            procs[p] = {
                "label": CLASS_LABELS[p], "pythia_settings": settings_for(cfg, p),
                "lepton_filter": p in cfg.lepton_filter.processes,
                "events": sum(r["events"] for r in rs), "generated": att, "passed_filter": passed,
                "filter_efficiency": passed / att if att else None,
                "cross_section_pb": sum(xs) / len(xs) if xs else None,
                "files": [{k: r[k] for k in ("file", "task", "events", "first_event", "pythia_seed", "numpy_seed",
                                             "attempts", "passed", "seconds", "cpu_seconds")} for r in rs],
            }
        sidecar = {"format": FORMAT, "seed": cfg.seed, "seed_rule": "numpy SeedSequence([seed, label, task])",
                   "versions": _versions(), "config": redact(cfg.model_dump(mode="json")), "processes": procs,
                   "tree": "Delphes"}
        job.write_json(SIDECAR, sidecar)
    dt = time.time() - t0
    n_all = sum(v["events"] for v in procs.values())
    log.info("simulate: wrote %d events in %.1f s (%.1f events/s)", n_all, dt, n_all / dt if dt else 0)
    return {"output": str(final), "sidecar": str(final.child(SIDECAR)),
            "files": {p: [str(final.child(f["file"])) for f in v["files"]] for p, v in procs.items()},
            "events": {p: v["events"] for p, v in procs.items()},
            "filter_efficiency": {p: v["filter_efficiency"] for p, v in procs.items()},
            "seconds": round(dt, 2)}
