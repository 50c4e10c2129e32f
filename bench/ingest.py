"""Benchmark: Spark ROOT -> Parquet ingestion (``ingest_root`` on ``local[N]``) against two single-
process peers on the same files, branches and run: a bare uproot -> pyarrow loop, and
``hepconvert.root_to_parquet`` (scikit-hep's converter, the tool a user would pick instead). Not a
test: prints measured figures and ratios (compare only numbers from the same run).

    .venv/bin/python bench/ingest.py [--copies 40] [--cores 2] [--branches all|config] [--repeat 3] [--small]

Input: ``--copies`` symlinks of the real ``delphes.root`` (5.4 MB, 25 events each). ``--branches
all`` (default) converts every branch (``filter_name ["*"]``: 1105 branches, arrays of ROOT objects
included; hepconvert converts all branches, containers included); ``config`` uses
``configs/ingest_root.yaml``'s ``filter_name`` for ingest_root and the bare loop. hepconvert
cannot select Delphes split-branch names (``keep_branches=["Jet.PT", ...]`` selects nothing and
fails), so it always converts all branches, and the hepconvert target is meaningful with
``--branches all``. All sides write snappy Parquet. The peers run in a fresh interpreter each
(one untimed warm-up file); the Spark side runs after one warm-up run (Python workers started)
and its time includes the driver's planning. Sides alternate ``--repeat`` times and the median
round is reported (a shared VM's speed drifts by tens of percent over minutes).

Targets: Spark per core >= 0.7 x bare; Spark on local[N] >= 0.9 x N x hepconvert's rate.
``--small`` (2 copies, 1 round) only shows that the script works.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def bare_convert(files, tree, branches, out_dir) -> float:
    """One process, file after file: uproot -> awkward -> Arrow -> Parquet. The first file is
    converted once untimed (imports, uproot's streamer classes)."""
    import pyarrow.parquet as pq
    import uproot

    from pipeline.ingest.root import read_arrays, to_arrow

    def convert(i, f):
        t = uproot.open(f)[tree]
        pq.write_table(to_arrow(read_arrays(t, branches, 0, t.num_entries)),
                       os.path.join(out_dir, f"part-{i:05d}.parquet"))

    convert(0, files[0])
    t0 = time.perf_counter()
    for i, f in enumerate(files):
        convert(i, f)
    return time.perf_counter() - t0


def hepconvert_convert(files, tree, out_dir) -> float:
    """hepconvert.root_to_parquet, file after file, every branch, snappy; first file untimed."""
    import hepconvert

    def convert(i, f):
        hepconvert.root_to_parquet(in_file=f, out_file=os.path.join(out_dir, f"part-{i:05d}.parquet"), tree=tree,
                                   force=True, compression="snappy")

    convert(0, files[0])
    t0 = time.perf_counter()
    for i, f in enumerate(files):
        convert(i, f)
    return time.perf_counter() - t0


def in_fresh_process(fn, *args) -> float:
    """``fn(*args)`` in a new interpreter, so that a peer does not share its process (heap, garbage
    collector, threads) with the Spark driver."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


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


def one_round(r: int, args, files, branches, filt, work: Path, spark, mb: float) -> dict:
    """bare, hepconvert and Spark on the same files; rates in MB (input on disk) per second."""
    from pipeline.ingest.root import IngestRootConfig, ingest_root

    t_bare = in_fresh_process(bare_convert, files, "Delphes", branches, _fresh(work / "bare"))
    t_hep = in_fresh_process(hepconvert_convert, files, "Delphes", _fresh(work / "hepconvert"))
    t0 = time.perf_counter()
    rep = ingest_root(IngestRootConfig(input=files, tree="Delphes", filter_name=filt, output=str(work / "spark"),
                                       schema_dir=str(work / "schemas")), spark=spark)
    t_spark = time.perf_counter() - t0
    assert rep["rows"] == len(files) * 25 and not rep["bad_files"]
    bare, hep, sp = mb / t_bare, mb / t_hep, mb / t_spark
    res = {"per_core_vs_bare": sp / args.cores / bare, "vs_n_hepconvert": sp / (args.cores * hep)}
    print(f"round {r + 1}: bare {t_bare:6.1f} s {bare:5.2f} MB/s | hepconvert {t_hep:6.1f} s {hep:5.2f} MB/s | "
          f"ingest_root local[{args.cores}] {t_spark:6.1f} s {sp:5.2f} MB/s = per core {res['per_core_vs_bare']:.2f}"
          f" x bare, {res['vs_n_hepconvert']:.2f} x (N x hepconvert)")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=40, help="copies of delphes.root (5.4 MB each)")
    ap.add_argument("--cores", type=int, default=2, help="Spark local[N]")
    ap.add_argument("--branches", choices=["all", "config"], default="all")
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds (median reported)")
    ap.add_argument("--small", action="store_true", help="smoke check: 2 copies, 1 round")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.small:
        args.copies, args.repeat = 2, 1

    import logging

    import yaml

    from pipeline.cli import setup_logging
    from pipeline.config import SparkConfig
    from pipeline.ingest.root import IngestRootConfig, ingest_root, plan_chunks
    from pipeline.samples import coffea_samples
    from pipeline.spark import get_spark

    setup_logging()
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    src = coffea_samples() / "delphes.root"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-ingest-"))
    (work / "input").mkdir(parents=True, exist_ok=True)
    files = symlink_copies(src, work / "input", "delphes", args.copies)
    mb = args.copies * src.stat().st_size / 1e6
    filt = ["*"] if args.branches == "all" else yaml.safe_load((REPO / "configs" / "ingest_root.yaml").read_text())["filter_name"]
    branches = plan_chunks([str(src)], "Delphes", filt, progress=False).branches
    print(f"input: {args.copies} x delphes.root = {mb:.0f} MB on disk, {args.copies * 25} events, {len(branches)} "
          f"branches ({args.branches}; hepconvert: all); Spark local[{args.cores}]; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    spark = get_spark(SparkConfig(master=f"local[{args.cores}]", app_name="bench-ingest", driver_memory="4g"))
    try:
        ingest_root(IngestRootConfig(input=files[:args.cores], tree="Delphes", filter_name=filt,
                                     output=str(work / "warm"), schema_dir=str(work / "schemas")), spark=spark)
        rounds = [one_round(r, args, files, branches, filt, work, spark, mb) for r in range(args.repeat)]
    finally:
        spark.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    for key, target, what in (("per_core_vs_bare", 0.7, "ingest_root per core / bare"),
                              ("vs_n_hepconvert", 0.9, f"ingest_root local[{args.cores}] / ({args.cores} x hepconvert)")):
        vals = [r[key] for r in rounds]
        print(f"{what}: median of {len(vals)} round(s) {statistics.median(vals):.2f} (target >= {target}; rounds "
              f"{', '.join(f'{v:.2f}' for v in vals)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
