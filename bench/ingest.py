"""Benchmark: Spark ROOT -> Parquet ingestion (``ingest_root`` on ``local[N]``) against two single-
process peers on the same files, branches and run: a bare uproot -> pyarrow loop, and
``hepconvert.root_to_parquet`` (scikit-hep's converter, the tool a user would pick instead); then
the same files read over ``root://`` from a real XRootD server on loopback against local reads.
Not a test: prints measured figures and ratios (compare only numbers from the same run).

    .venv/bin/python bench/ingest.py [--copies 8] [--cores 2] [--branches all|config] [--repeat 3]
                                     [--no-remote] [--small]

Input: ``--copies`` symlinks of the real ``delphes.root`` (5.4 MB, 25 events each). ``--branches
all`` (default) converts every branch (``filter_name ["*"]``: 1105 branches, arrays of ROOT objects
included; hepconvert converts all branches, containers included). ``config`` uses
``configs/ingest_root.yaml``'s ``filter_name`` (the feature branches) for ingest_root and the bare
loop; hepconvert cannot select Delphes split-branch names (its ``keep_branches`` matches only
top-level branches: ``keep_branches=["Jet.PT"]`` selects nothing and fails), so with ``config``
hepconvert is not run and the hepconvert target is measured on all branches (``--branches all``).

All sides write snappy Parquet without dictionary encoding, with column statistics (ingest_root's
``PARQUET_WRITE_OPTIONS``, hepconvert's defaults with ``compression="snappy"``). Each peer runs in
its own interpreter, started once and warmed up on one untimed file; the Spark side runs after one
warm-up run (Python workers started) and its time includes the driver's planning and schema read.
The sides run ``--repeat`` rounds in a rotating order and the median round is reported (a shared
VM's speed drifts by tens of percent over minutes).

Targets: ingest_root per core >= 0.7 x bare; ingest_root on local[N] >= 0.9 x N x hepconvert's
single-process rate (PASS/FAIL printed). The ``root://`` row (``--no-remote`` skips it) copies
the files into a folder exported by ``xrootd`` (``tests/servers.xrootd_server``; Debian package
``xrootd-server``), runs ``ingest_root`` on the ``root://127.0.0.1:PORT//...`` URLs and on the
local copies in alternating rounds, prints MB/s of each and their ratio, and stops the server.
``--small`` (2 copies, 1 round) only shows that the script works.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TREE = "Delphes"
EVENTS_PER_FILE = 25


def bare_convert(files, branches, out_dir) -> float:
    """One process, file after file: uproot -> awkward -> Arrow -> Parquet, with ingest_root's
    tree opening, conversion and Parquet options; seconds."""
    import pyarrow.parquet as pq

    from pipeline.ingest.root import PARQUET_WRITE_OPTIONS, open_tree, read_arrays, to_arrow

    t0 = time.perf_counter()
    for i, f in enumerate(files):
        t = open_tree(f, TREE)
        pq.write_table(to_arrow(read_arrays(t, branches, 0, t.num_entries)),
                       os.path.join(out_dir, f"part-{i:05d}.parquet"), **PARQUET_WRITE_OPTIONS)
    return time.perf_counter() - t0


def hepconvert_convert(files, branches, out_dir) -> float:
    """hepconvert.root_to_parquet, file after file, every branch, snappy; seconds."""
    import hepconvert

    t0 = time.perf_counter()
    for i, f in enumerate(files):
        hepconvert.root_to_parquet(in_file=f, out_file=os.path.join(out_dir, f"part-{i:05d}.parquet"), tree=TREE,
                                   force=True, compression="snappy")
    return time.perf_counter() - t0


class Peer:
    """A single-process converter in its own interpreter (it shares no heap, garbage collector or
    threads with the Spark driver), started once and warmed up on one untimed file."""

    def __init__(self, name: str, fn, files, branches, work: Path):
        import multiprocessing as mp

        self.name, self.fn, self.branches, self.work = name, fn, branches, work
        self.pool = mp.get_context("spawn").Pool(1)
        self.pool.apply(fn, ([files[0]], branches, _fresh(work / f"{name}-warm")))

    def run(self, files) -> float:
        return self.pool.apply(self.fn, (files, self.branches, _fresh(self.work / self.name)))

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def symlink_copies(src: Path, folder: Path, stem: str, n: int) -> list[str]:
    """``n`` symlinks ``folder/<stem>_NNN.root`` -> ``src`` (kept if already there)."""
    out = []
    for i in range(n):
        p = folder / f"{stem}_{i:03d}.root"
        if not p.exists():
            p.symlink_to(src)
        out.append(str(p))
    return out


def _fresh(folder: Path) -> str:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return str(folder)


def spark_convert(spark, files, filt, out: Path, schemas: Path) -> float:
    """``ingest_root`` of ``files`` (driver planning and schema read included); seconds."""
    from pipeline.ingest.root import IngestRootConfig, ingest_root

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):          # its per-file lines
        rep = ingest_root(IngestRootConfig(input=files, tree=TREE, filter_name=filt, output=str(out),
                                           schema_dir=str(schemas)), spark=spark)
    seconds = time.perf_counter() - t0
    if rep["rows"] != len(files) * EVENTS_PER_FILE or rep["bad_files"]:
        raise RuntimeError(f"ingest_root wrote {rep['rows']} rows, bad files {rep['bad_files'][:1]}")
    return seconds


def _median_line(what: str, vals: list[float], target: float | None = None) -> str:
    med = statistics.median(vals)
    verdict = "" if target is None else f" (target >= {target}: {'PASS' if med >= target else 'FAIL'})"
    return f"{what}: median of {len(vals)} round(s) {med:.2f}{verdict}; rounds {', '.join(f'{v:.2f}' for v in vals)}"


def converter_rounds(args, spark, files, branches, filt, work: Path, mb: float) -> list[str]:
    """bare, hepconvert (all branches only) and ingest_root in rotating order; the summary lines."""
    peers = {"bare": Peer("bare", bare_convert, files, branches, work)}
    if args.branches == "all":
        peers["hepconvert"] = Peer("hepconvert", hepconvert_convert, files, branches, work)
    sides = [*peers, "ingest_root"]
    ratios: dict[str, list[float]] = {"per_core_vs_bare": [], "vs_n_hepconvert": []}
    try:
        for r in range(args.repeat):
            secs = {}
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                secs[side] = (spark_convert(spark, files, filt, work / "spark", work / "schemas")
                              if side == "ingest_root" else peers[side].run(files))
            rate = {k: mb / v for k, v in secs.items()}
            ratios["per_core_vs_bare"].append(rate["ingest_root"] / args.cores / rate["bare"])
            line = " | ".join(f"{k} {secs[k]:6.1f} s {rate[k]:5.2f} MB/s" for k in sides)
            if "hepconvert" in rate:
                ratios["vs_n_hepconvert"].append(rate["ingest_root"] / (args.cores * rate["hepconvert"]))
                line += f" | ingest_root / ({args.cores} x hepconvert) {ratios['vs_n_hepconvert'][-1]:.2f}"
            print(f"round {r + 1} (load {os.getloadavg()[0]:.1f}): {line}", flush=True)
    finally:
        for p in peers.values():
            p.close()
    out = [_median_line("ingest_root per core / bare", ratios["per_core_vs_bare"], 0.7)]
    if ratios["vs_n_hepconvert"]:
        out.append(_median_line(f"ingest_root local[{args.cores}] / ({args.cores} x hepconvert single process)",
                                ratios["vs_n_hepconvert"], 0.9))
    else:
        out.append("hepconvert: not run with --branches config (it cannot select Delphes split-branch names); "
                   "its target is measured on all branches: --branches all")
    return out


def remote_rounds(args, spark, src: Path, filt, work: Path, mb: float) -> list[str]:
    """ingest_root over root:// from a loopback XRootD server against the same local files."""
    sys.path.insert(0, str(REPO / "tests"))
    from servers import xrootd_server

    export = work / "xrootd-export"
    export.mkdir(parents=True, exist_ok=True)
    local = []
    for i in range(args.copies):                 # real copies: the server runs as nobody
        p = export / f"delphes_{i:03d}.root"
        shutil.copyfile(src, p)
        local.append(str(p))
    (work / "xrootd-log").mkdir(exist_ok=True)
    rates: dict[str, list[float]] = {"local": [], "root://": []}
    with xrootd_server(export, work / "xrootd-log") as server:
        remote = [server.url(p) for p in local]
        print(f"root:// row: {args.copies} files served by xrootd on 127.0.0.1:{server.port} ({remote[0]})",
              flush=True)
        spark_convert(spark, remote[:args.cores], filt, work / "remote-warm", work / "schemas")
        for r in range(args.repeat):
            order = [("local", local), ("root://", remote)]
            for name, fl in order if r % 2 == 0 else order[::-1]:
                rates[name].append(mb / spark_convert(spark, fl, filt, work / "remote-out", work / "schemas"))
            print(f"remote round {r + 1} (load {os.getloadavg()[0]:.1f}): ingest_root local "
                  f"{rates['local'][-1]:5.2f} MB/s | root:// {rates['root://'][-1]:5.2f} MB/s", flush=True)
    return [f"ingest_root local[{args.cores}] over root:// (loopback xrootd): median {statistics.median(rates['root://']):.2f}"
            f" MB/s, local files {statistics.median(rates['local']):.2f} MB/s",
            _median_line("root:// / local", [a / b for a, b in zip(rates["root://"], rates["local"])])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=8, help="copies of delphes.root (5.4 MB each)")
    ap.add_argument("--cores", type=int, default=2, help="Spark local[N]")
    ap.add_argument("--branches", choices=["all", "config"], default="all")
    ap.add_argument("--repeat", type=int, default=3, help="rounds in rotating order (median reported)")
    ap.add_argument("--no-remote", action="store_true", help="skip the root:// row")
    ap.add_argument("--small", action="store_true", help="smoke check: 2 copies, 1 round")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.small:
        args.copies, args.repeat = 2, 1
    if args.copies < args.cores or args.repeat < 1:
        ap.error("--copies must be >= --cores and --repeat >= 1")

    import logging

    import yaml

    from pipeline.cli import setup_logging
    from pipeline.config import SparkConfig
    from pipeline.ingest.root import plan_chunks
    from pipeline.samples import coffea_samples
    from pipeline.spark import get_spark

    setup_logging()
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    t_start = time.perf_counter()
    src = coffea_samples() / "delphes.root"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-ingest-"))
    (work / "input").mkdir(parents=True, exist_ok=True)
    files = symlink_copies(src, work / "input", "delphes", args.copies)
    mb = args.copies * src.stat().st_size / 1e6
    filt = ["*"] if args.branches == "all" else yaml.safe_load((REPO / "configs" / "ingest_root.yaml").read_text())["filter_name"]
    branches = plan_chunks([str(src)], TREE, filt, progress=False).branches
    print(f"input: {args.copies} x delphes.root = {mb:.0f} MB on disk, {args.copies * EVENTS_PER_FILE} events, "
          f"{len(branches)} branches ({args.branches}); Spark local[{args.cores}]; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    spark = get_spark(SparkConfig(master=f"local[{args.cores}]", app_name="bench-ingest", driver_memory="4g"))
    try:
        spark_convert(spark, files[:args.cores], filt, work / "warm", work / "schemas")
        summary = converter_rounds(args, spark, files, branches, filt, work, mb)
        if not args.no_remote:
            summary += remote_rounds(args, spark, src, filt, work, mb)
    finally:
        spark.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(summary))
    print(f"bench/ingest.py: {time.perf_counter() - t_start:.0f} s, load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
