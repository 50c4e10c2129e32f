"""Benchmark: a day's only-new-files run on a Delta table holding many files vs a plain run over
just the new files.

Setup (untimed): ``--held`` copies of the real NanoAOD sample ``nano_dy.root`` (40 entries, the
branches of ``--branches``) land in a folder and are ingested into a Delta table in one run
(``output_format: delta``, ``mode: new_files``). Each round then lands ``--new`` more copies and
times, in alternating order on the same Spark session:

* **only-new**: ``ingest_root`` with ``mode: new_files`` over the whole landing glob (``held +
  new`` files): the table's source ledger is read, every landed file is looked up (size,
  modification time), and only the new ones are read and committed as one Delta version;
* **plain**: ``ingest_root`` with the default Parquet output over just the new files (a fresh
  output folder each round), the cost a user would pay knowing the new files by hand.

Both include the driver's planning, the Spark passes and the commit. Printed per round: the two
times and their ratio; then the median and the spread (min-max) of the ratio over ``--repeat``
rounds, and PASS/FAIL against the target ratio <= 1.5. The machine's load average (``uptime``) is
printed first and last: run it alone on an idle machine.

    .venv/bin/python bench/ingest_delta_new_files.py                       # 500 held + 10 new, 3 rounds
    .venv/bin/python bench/ingest_delta_new_files.py --held 50 --repeat 1  # smoke check
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.5


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _land(src: Path, folder: Path, start: int, n: int) -> list[Path]:
    out = []
    for i in range(start, start + n):
        p = folder / f"f{i:05d}.root"
        shutil.copy(src, p)
        out.append(p)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held", type=int, default=500, help="files the table holds before the rounds")
    ap.add_argument("--new", type=int, default=10, help="files landing each round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds")
    ap.add_argument("--branches", default="run,luminosityBlock,event,nMuon,Muon_pt,Muon_eta,Muon_phi,Muon_charge",
                    help="comma-separated branches of nano_dy.root to ingest")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    from pipeline.config import SparkConfig
    from pipeline.ingest.root import IngestRootConfig, ingest_root
    from pipeline.samples import coffea_samples
    from pipeline.spark import get_spark

    print(f"machine: {os.cpu_count()} cores; {_uptime()}", flush=True)
    src = coffea_samples() / "nano_dy.root"
    branches = [b.strip() for b in args.branches.split(",") if b.strip()]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-delta-"))
    landing, table = work / "landing", work / "table"
    landing.mkdir(parents=True, exist_ok=True)
    spark = get_spark(SparkConfig(master=args.master, log_level="error"))

    def quiet(fn, cfg):
        """The stage without its per-file lines (they would bury the table)."""
        with contextlib.redirect_stdout(io.StringIO()):
            return fn(cfg, spark)

    def delta():
        return IngestRootConfig(input=str(landing / "*.root"), tree="Events", filter_name=branches, output=str(table),
                                output_format="delta", mode="new_files")

    def plain(files, out):
        return IngestRootConfig(input=[str(f) for f in files], tree="Events", filter_name=branches, output=str(out))

    try:
        t0 = time.perf_counter()
        _land(src, landing, 0, args.held)
        r = quiet(ingest_root, delta())
        print(f"setup: {args.held} files ingested into the table (version {r['version']}, {r['rows']} rows) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        warm = _land(src, landing, args.held, args.new)          # warm-up of both paths, untimed
        quiet(ingest_root, plain(warm, work / "warm"))
        quiet(ingest_root, delta())
        n, ratios = args.held + args.new, []
        print(f"{'round':>5} {'held':>6} {'new':>4} {'only-new s':>11} {'plain s':>8} {'ratio':>6}", flush=True)
        for k in range(args.repeat):
            new = _land(src, landing, n, args.new)
            held, n = n, n + args.new
            times = {}
            order = ("delta", "plain") if k % 2 == 0 else ("plain", "delta")
            for side in order:
                t = time.perf_counter()
                if side == "delta":
                    rep = quiet(ingest_root, delta())
                    assert rep["new_files"] == args.new and rep["held_files"] == held, rep
                else:
                    quiet(ingest_root, plain(new, work / f"plain{k}"))
                times[side] = time.perf_counter() - t
            ratios.append(times["delta"] / times["plain"])
            print(f"{k + 1:>5} {held:>6} {args.new:>4} {times['delta']:>11.2f} {times['plain']:>8.2f} "
                  f"{ratios[-1]:>6.2f}", flush=True)
        med = statistics.median(ratios)
        verdict = "PASS" if med <= TARGET else "FAIL"
        print(f"only-new / plain: median {med:.2f}, spread {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} "
              f"round(s) (target <= {TARGET}): {verdict}")
        print(f"machine: {_uptime()}")
        return 0 if verdict == "PASS" else 1
    finally:
        spark.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
