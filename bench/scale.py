"""Benchmark: the HEP pipeline without the simulation at growing numbers of events, to show that
no stage's cost per event and no driver's memory grows with the events.

    .venv/bin/python bench/scale.py [--sizes 10000,100000,1000000] [--llf-max 100000] [--cores 2]
        [--workers 2] [--sim-events 4000] [--events-per-file 2000] [--workdir DIR] [--small]

Stages, in the order the data takes (each in a driver process of its own, as ``spark-submit``
runs them): ROOT ingestion of the simulated files (``ingest_root``), the feature stage on the
ingested dataset (``features``), the HLF shards for ``--workers`` workers (``shards_hlf``), the
LLF shards up to ``--llf-max`` events (``shards_llf``: a padded row takes about 61 kB), one epoch
of HLF training on the shards (``train``, local launcher). The input of each size is copies (hard
links) of ``--sim-events`` simulated ttbar events in files of ``--events-per-file``, spread over
the qcd/, ttbar/ and wjets/ folders the default samples label (the classes' physics does not
matter here), generated once with ``pipeline.simulate`` and cached under
``<data cache>/bench-scale/``.

Printed per size and stage: seconds (the stage function alone, the driver's Spark session
already up), seconds per event read, the peak RSS of the Python driver process (``ru_maxrss``:
where the pipeline's driver code runs; with a local master the JVM also hosts the executors, so
its peak, sampled, is printed apart for information) and the bytes the driver received from the
tasks (the ``Result Size`` of every task in Spark's event log). Then the targets, per stage:
seconds per event at the largest size within 1.25x of the size before it, and the Python driver's
peak RSS at the largest size at most 256 MB above the smallest. Each size's outputs are deleted
once measured (``--keep`` keeps them); the disk a size used is printed.

``--small`` (sizes 400 and 800, 200 simulated events) only shows the script works. Run the
real thing alone on an idle machine.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGES = ("ingest_root", "features", "shards_hlf", "shards_llf", "train")
CLASSES = ("qcd", "ttbar", "wjets")
RSS_TARGET_MB = 256
SPE_TARGET = 1.25


# ----------------------------------------------------------------------------- one stage (child process)
def _stage_call(stage: str, root: Path, cores: int, workers: int):
    """The stage's function and config for the data of one size under ``root``."""
    from pipeline.features.delphes import REQUIRED_BRANCHES

    if stage == "ingest_root":
        from pipeline.ingest.root import IngestRootConfig, ingest_root
        return ingest_root, IngestRootConfig(input=f"{root}/input/*/*.root", tree="Delphes", output=str(root / "events"),
                                             filter_name=list(REQUIRED_BRANCHES))
    if stage == "features":
        from pipeline.features.stage import FeaturesConfig, build_features
        samples = [{"name": c, "label": i, "files": [f"*/{c}/*.root"]} for i, c in enumerate(CLASSES)]
        return build_features, FeaturesConfig(input=str(root / "events"), samples=samples, output=str(root / "features"))
    if stage in ("shards_hlf", "shards_llf"):
        from pipeline.shards.materialize import ShardConfig, shard
        name = stage.split("_")[1]
        return shard, ShardConfig(input=str(root / "features" / name), output=str(root / stage), workers=workers)
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train
    return train, TrainConfig(manifest=str(root / "shards_hlf" / "manifest.json"), output=str(root / "train"),
                              scaling=str(root / "features" / "scaling.json"), launcher="local", workers=workers,
                              model="hlf", optimizer="adam", lr=0.001, epochs=1, batch_size=64, warmup_epochs=0.0,
                              progress=False)


def _jvm_peak(stop: threading.Event, out: dict) -> None:
    """Sample the RSS of the JVM children of this process until ``stop``."""
    try:
        import psutil
    except ImportError:
        return
    me = psutil.Process()
    while not stop.wait(0.2):
        try:
            rss = sum(c.memory_info().rss for c in me.children(recursive=False) if "java" in c.name())
        except psutil.Error:
            continue
        out["jvm"] = max(out.get("jvm", 0), rss)


def run_child(req: dict) -> dict:
    from pipeline.config import SparkConfig
    from pipeline.spark import get_spark

    stop, jvm = threading.Event(), {}
    sampler = threading.Thread(target=_jvm_peak, args=(stop, jvm), daemon=True)
    sampler.start()
    spark = get_spark(SparkConfig(master=f"local[{req['cores']}]", app_name=f"scale-{req['stage']}",
                                  driver_memory="4g", conf={"spark.eventLog.enabled": "true",
                                                            "spark.eventLog.dir": "file://" + req["eventlog"],
                                                            "spark.eventLog.compress": "false",
                                                            "spark.eventLog.rolling.enabled": "false"}))
    fn, cfg = _stage_call(req["stage"], Path(req["root"]), req["cores"], req["workers"])
    t0 = time.perf_counter()
    fn(cfg, spark)
    seconds = time.perf_counter() - t0
    spark.stop()
    stop.set()
    sampler.join()
    return {"seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "jvm_mb": jvm.get("jvm", 0) / 2**20}


# ----------------------------------------------------------------------------- the driver of the benchmark
def received_bytes(eventlog: Path) -> int:
    """The bytes of task results the driver received: the ``Result Size`` of every finished task
    in the Spark event logs under ``eventlog``."""
    total = 0
    for f in (p for p in eventlog.rglob("*") if p.is_file()):
        with open(f) as src:
            for line in src:
                if '"SparkListenerTaskEnd"' in line:
                    total += int(json.loads(line).get("Task Metrics", {}).get("Result Size", 0))
    return total


def stage(name: str, root: Path, args) -> dict:
    eventlog = root / "_eventlog" / name
    eventlog.mkdir(parents=True)
    req = {"stage": name, "root": str(root), "cores": args.cores, "workers": args.workers, "eventlog": str(eventlog)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(req)], capture_output=True, text=True,
                       env=env, cwd=str(REPO))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("STAGE ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    out = json.loads(lines[-1][6:])
    out["received"] = received_bytes(eventlog)
    return out


def simulated_files(args) -> list[str]:
    """The simulated ttbar files: ``--sim-dir``, or generated once into the data cache."""
    if args.sim_dir:
        return sorted(glob.glob(os.path.join(args.sim_dir, "**", "*.root"), recursive=True))
    from pipeline.config import SparkConfig
    from pipeline.samples import data_cache
    from pipeline.simulate import SimulateConfig, generate
    from pipeline.spark import get_spark

    out = data_cache() / "bench-scale" / f"ttbar-{args.sim_events}ev-{args.events_per_file}perfile-seed7"
    files = sorted(glob.glob(str(out / "ttbar" / "*.root")))
    if files:
        return files
    spark = get_spark(SparkConfig(master=f"local[{args.cores}]", app_name="scale-simulate"))
    t0 = time.perf_counter()
    files = generate(SimulateConfig(processes=["ttbar"], events=args.sim_events, events_per_file=args.events_per_file,
                                    seed=7, output=str(out), progress=False), spark=spark)["files"]["ttbar"]
    spark.stop()
    print(f"simulated {args.sim_events} ttbar events in {len(files)} file(s) ({time.perf_counter() - t0:.0f} s), "
          f"cached in {out}", flush=True)
    return sorted(files)


def make_input(files: list[str], per_file: int, events: int, root: Path) -> int:
    """Hard links (copies where links fail) of the simulated files, ``events`` in all, over the
    class folders; the events actually linked."""
    n, i = 0, 0
    while n < events:
        d = root / "input" / CLASSES[i % len(CLASSES)]
        d.mkdir(parents=True, exist_ok=True)
        dst = d / f"f{i:06d}.root"
        try:
            os.link(files[i % len(files)], dst)
        except OSError:
            shutil.copyfile(files[i % len(files)], dst)
        n, i = n + per_file, i + 1
    return n


def disk_mb(root: Path) -> dict[str, float]:
    """MB written under each output directory of a size (the input's links not counted)."""
    out: dict[str, float] = {}
    for top in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in ("input", "_eventlog")):
        out[top.name] = sum(f.stat().st_blocks * 512 for f in top.rglob("*") if f.is_file()) / 1e6
    return out


def report(results: dict, sizes: list[int]) -> None:
    print(f"\n{'stage':<12}{'events':>10}{'s':>9}{'us/event':>10}{'driver RSS MB':>15}{'JVM RSS MB':>12}"
          f"{'received B':>14}")
    for name in STAGES:
        for n in sizes:
            r = results.get((name, n))
            if r:
                print(f"{name:<12}{n:>10}{r['seconds']:>9.1f}{1e6 * r['seconds'] / n:>10.1f}{r['rss_mb']:>15.0f}"
                      f"{r['jvm_mb']:>12.0f}{r['received']:>14}")
    print(f"\ntargets: seconds per event at the largest size within {SPE_TARGET}x of the size before; Python "
          f"driver peak RSS at the largest size at most {RSS_TARGET_MB} MB above the smallest")
    for name in STAGES:
        have = [n for n in sizes if (name, n) in results]
        if len(have) < 2:
            continue
        a, b, lo = results[(name, have[-2])], results[(name, have[-1])], results[(name, have[0])]
        spe = (b["seconds"] / have[-1]) / (a["seconds"] / have[-2])
        rss = b["rss_mb"] - lo["rss_mb"]
        ok = spe <= SPE_TARGET and rss <= RSS_TARGET_MB
        print(f"  {name:<12} s/event {have[-1]} vs {have[-2]}: {spe:.2f}x; RSS {have[-1]} - {have[0]}: "
              f"{rss:+.0f} MB  {'PASS' if ok else 'FAIL'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="events per run, comma-separated")
    ap.add_argument("--llf-max", type=int, default=100_000, help="LLF shards only up to this many events")
    ap.add_argument("--cores", type=int, default=2, help="Spark local[N]")
    ap.add_argument("--workers", type=int, default=2, help="shards and training workers")
    ap.add_argument("--sim-events", type=int, default=4000, help="simulated ttbar events (copied to every size)")
    ap.add_argument("--events-per-file", type=int, default=2000)
    ap.add_argument("--sim-dir", default=None, help="use the ROOT files under this folder instead of simulating "
                                                    "(each holding --events-per-file events)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep every size's outputs")
    ap.add_argument("--small", action="store_true", help="smoke check: sizes 400,800, 200 simulated events")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("STAGE " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return 0
    if args.small:
        args.sizes, args.sim_events, args.events_per_file = "400,800", 200, 200
    sizes = sorted(int(s) for s in args.sizes.split(","))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; local[{args.cores}], {args.workers} "
          f"workers", flush=True)
    files = simulated_files(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-scale-"))
    results: dict = {}
    try:
        for n in sizes:
            root = work / f"n{n}"
            events = make_input(files, args.events_per_file, n, root)
            if events != n:
                print(f"{n} events asked, {events} linked (whole files of {args.events_per_file})")
            for name in STAGES:
                if name == "shards_llf" and n > args.llf_max:
                    continue
                results[(name, n)] = r = stage(name, root, args)
                print(f"  {n} events, {name}: {r['seconds']:.1f} s, driver RSS {r['rss_mb']:.0f} MB, received "
                      f"{r['received']} B (load average {os.getloadavg()[0]:.1f})", flush=True)
            used = disk_mb(root)
            print(f"  {n} events: {sum(used.values()):.0f} MB written ("
                  + ", ".join(f"{k} {v:.0f}" for k, v in used.items()) + ")", flush=True)
            if not args.keep:
                shutil.rmtree(root)
        report(results, sizes)
    finally:
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
        if not args.workdir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
