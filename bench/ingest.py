"""Benchmark: Spark ROOT -> Parquet ingestion (``ingest_root`` on ``local[N]``) against two single-
process peers on the same files, branches and run: a bare uproot -> pyarrow loop, and
``hepconvert.root_to_parquet`` (scikit-hep's converter, the tool a user would pick instead); for
Delphes also the same files read over ``root://`` from a real XRootD server on loopback against
local reads. Not a test: prints measured figures and ratios (compare only numbers from the same run).

    .venv/bin/python bench/ingest.py [--case nano|delphes|all] [--cores 2] [--repeat 3]
                                     [--nano-copies 20] [--large-events 100000] [--profile]
                                     [--copies 8] [--branches all|config] [--no-remote] [--small]

Cases (``--case``; the default ``nano`` runs the two NanoAOD ones, in a few minutes):

* ``nano-small``: ``--nano-copies`` symlinks of the real CMS NanoAOD ``nano_dy.root`` (345 KB, 40
  events, 1,499 branches, ZLIB level 1), all branches. The issue's size: ``--nano-copies 200``.
* ``nano-large``: one NanoAOD-like file of ``--large-events`` events written with uproot from
  ``nano_dy.root``'s own arrays (every replica a seeded permutation of its 40 real events, so no
  value is invented), the same 1,499 branches, ZLIB level 1, clusters of 5,000 events; written once
  into the data cache (``$PIPELINE_DATA/bench-ingest/``, never the checkout). Its branches repeat
  40 values, so its baskets compress about 6x (the real file's: 1.5x): it is sized by events
  (10^5 events, the default and the issue's size: 92 MB on disk).
* ``delphes``: ``--copies`` symlinks of the real ``delphes.root`` (5.4 MB, 25 events), ``--branches
  all`` (1105 branches, arrays of ROOT objects included) or ``config`` (``configs/ingest_root.yaml``'s
  feature branches; hepconvert cannot select Delphes split-branch names, so it is not run then),
  then the ``root://`` row (``--no-remote`` skips it): real copies served by ``xrootd``
  (``tests/servers.xrootd_server``) read by ``ingest_root`` against the local copies.

All sides write snappy Parquet without dictionary encoding, with column statistics (ingest_root's
``PARQUET_WRITE_OPTIONS``, hepconvert's defaults with ``compression="snappy"``). Each peer runs in
its own interpreter, started once and warmed up on one untimed file; the Spark side runs after one
warm-up run (Python workers started) and its time includes the driver's planning and schema read;
every run opens its files anew (a Python worker keeps an open tree for one job only).
The sides run ``--repeat`` rounds in a rotating order and the median round is reported (a shared
VM's speed drifts by tens of percent over minutes); every round prints the load average.

Per case: hepconvert s / ingest_root s / N (the ratio per core), ingest_root's MB/s per core
(bytes on disk) against the decompression limit (the same file's ZLIB blocks decompressed in one
process with the library ingest_root uses, :func:`decompress_limit`), and the Parquet bytes written
by each side. Targets (PASS/FAIL): nano-small per core >= 1.5 x hepconvert; nano-large per core
>= 1.2 x hepconvert and >= 0.5 x the decompression limit; delphes local[N] >= 0.9 x N x hepconvert
and per core >= 0.7 x bare. ``--profile`` prints, before the rounds, where one process's time goes
on each NanoAOD case (:func:`profile_split`, the table of docs/ingestion.md#performance), ``--ab``
each change of the read measured in one process (:func:`ab_steps`), ``--no-rounds`` only those.
``--small`` (2 copies, 1 round, 2,000 large events) only shows that the script works.
"""
from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LARGE_CLUSTER = 5000          # entries per basket cluster of the generated large NanoAOD file


@dataclass
class Case:
    """One input set: its files, tree, entries in all, bytes on disk and the branch selection."""

    name: str
    files: list
    tree: str
    events: int
    mb: float
    filt: list
    branches: list
    hepconvert: bool = True


def bare_convert(files, tree, branches, out_dir) -> tuple[float, int]:
    """One process, file after file: ingest_root's tree opening, read (:func:`read_arrow`) and
    Parquet options; (seconds, Parquet bytes)."""
    import pyarrow.parquet as pq

    from pipeline.ingest.root import PARQUET_WRITE_OPTIONS, open_tree, read_arrow

    t0 = time.perf_counter()
    for i, f in enumerate(files):
        t = open_tree(f, tree)
        pq.write_table(read_arrow(t, branches, 0, t.num_entries), os.path.join(out_dir, f"part-{i:05d}.parquet"),
                       **PARQUET_WRITE_OPTIONS)
    return time.perf_counter() - t0, _bytes(out_dir)


def hepconvert_convert(files, tree, branches, out_dir) -> tuple[float, int]:
    """hepconvert.root_to_parquet, file after file, every branch, snappy; (seconds, Parquet bytes)."""
    import hepconvert

    t0 = time.perf_counter()
    for i, f in enumerate(files):
        hepconvert.root_to_parquet(in_file=f, out_file=os.path.join(out_dir, f"part-{i:05d}.parquet"), tree=tree,
                                   force=True, compression="snappy")
    return time.perf_counter() - t0, _bytes(out_dir)


def _bytes(folder) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*.parquet"))


class Peer:
    """A single-process converter in its own interpreter (it shares no heap, garbage collector or
    threads with the Spark driver), started once and warmed up on one untimed file."""

    def __init__(self, name: str, fn, case: Case, work: Path):
        import multiprocessing as mp

        self.name, self.fn, self.case, self.work = name, fn, case, work
        self.pool = mp.get_context("spawn").Pool(1)
        self.pool.apply(fn, ([case.files[0]], case.tree, case.branches, _fresh(work / f"{name}-warm")))

    def run(self) -> tuple[float, int]:
        return self.pool.apply(self.fn, (self.case.files, self.case.tree, self.case.branches,
                                         _fresh(self.work / self.name)))

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def symlink_copies(src: Path, folder: Path, stem: str, n: int) -> list[str]:
    """``n`` symlinks ``folder/<stem>_NNN.root`` -> ``src`` (kept if already there)."""
    folder.mkdir(parents=True, exist_ok=True)
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


def large_nanoaod(src: Path, events: int, cache: Path) -> Path:
    """A NanoAOD-like file of ``events`` entries (a multiple of :data:`LARGE_CLUSTER`, or fewer)
    written with uproot from ``src``'s arrays: every replica a seeded permutation of the real
    events, the same branches (a collection's members zipped under its counter ``nX``, as NanoAOD
    has them), ZLIB level 1, one basket cluster per :data:`LARGE_CLUSTER` entries. Cached by size."""
    import awkward as ak
    import numpy as np
    import uproot

    out = cache / f"nano_dy_x{events}.root"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    t = uproot.open(src)["Events"]
    arr = t.arrays(library="ak")
    n_src = int(t.num_entries)
    counted: dict[str, list[str]] = {}
    for name, b in t.iteritems():
        leaf = b.member("fLeaves")[0].member("fLeafCount")
        if leaf is not None:
            counted.setdefault(leaf.member("fName"), []).append(name)
    per = min(events, LARGE_CLUSTER)
    rng = np.random.default_rng(55)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with uproot.recreate(tmp, compression=uproot.ZLIB(1)) as f:
        tree = None
        for _ in range(max(1, events // per)):
            perm = np.concatenate([rng.permutation(n_src) for _ in range(-(-per // n_src))])[:per]
            chunk: dict = {}
            for name in t.keys():
                if name in counted:
                    continue                                     # uproot writes the counters
                counter = b_counter(t, name)
                if counter is None:
                    chunk[name] = ak.to_numpy(arr[name])[perm]
                elif counter[1:] not in chunk:
                    group, members = counter[1:], counted[counter]
                    part = arr[members][perm]
                    chunk[group] = part[group] if members == [group] else ak.zip(
                        {m[len(group) + 1:]: part[m] for m in members})
            if tree is None:
                types = {k: v.type if hasattr(v, "layout") else v.dtype for k, v in chunk.items()}
                tree = f.mktree("Events", types, field_name=lambda outer, inner: f"{outer}_{inner}")
            tree.extend(chunk)
    os.replace(tmp, out)
    return out


def b_counter(t, name: str):
    leaf = t[name].member("fLeaves")[0].member("fLeafCount")
    return None if leaf is None else leaf.member("fName")


def zlib_blocks(path: str, tree: str) -> list[tuple[bytes, int]]:
    """Every ZLIB block of the tree's baskets as (compressed bytes, uncompressed size), from the
    basket keys (ROOT's 9-byte block header: "ZL", method, 3-byte sizes)."""
    import uproot

    raw = Path(path).read_bytes()
    blocks = []
    for _, b in uproot.open(path)[tree].iteritems():
        for seek, nbytes in zip(b.member("fBasketSeek")[:b.num_baskets], b.member("fBasketBytes")[:b.num_baskets]):
            start, stop = int(seek), int(seek) + int(nbytes)
            if nbytes == 0:
                continue
            keylen = int.from_bytes(raw[start + 14:start + 16], "big")
            objlen = int.from_bytes(raw[start + 6:start + 10], "big")
            pos = start + keylen
            if stop - pos == objlen:
                continue                                         # stored uncompressed
            while pos < stop:
                h = raw[pos:pos + 9]
                if h[:2] != b"ZL":
                    raise RuntimeError(f"{path}: a basket block compressed with {h[:2]!r}, not ZLIB")
                c, u = int.from_bytes(h[3:6], "little"), int.from_bytes(h[6:9], "little")
                blocks.append((raw[pos + 9:pos + 9 + c], u))
                pos += 9 + c
    return blocks


def decompress_limit(files: list[str], tree: str) -> dict:
    """The physical anchor: MB on disk of ``files`` and the seconds to decompress all their ZLIB
    blocks in one process with zlib and with the library ingest_root uses; the best of 3."""
    import zlib

    from pipeline.ingest.uproot_adapter import use_fast_zlib

    lib = use_fast_zlib()
    fast = zlib.decompress
    if lib == "isal":
        from isal.isal_zlib import decompress as fast
    blocks = [b for f in dict.fromkeys(files) for b in zlib_blocks(f, tree)]
    copies = len(files) / len(dict.fromkeys(files))
    out = {"library": lib, "mb": copies * sum(os.path.getsize(f) for f in dict.fromkeys(files)) / 1e6,
           "uncompressed_mb": copies * sum(u for _, u in blocks) / 1e6}
    for name, fn in (("zlib", zlib.decompress), (lib, fast)):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for c, u in blocks:
                fn(c, bufsize=u)
            best = min(best, time.perf_counter() - t0)
        out[name] = best * copies
    return out


def profile_split(case: Case, limit_files: int = 20) -> list[tuple[str, float]]:
    """Where one process's time goes on (up to ``limit_files`` of) the case's files, run as the
    tasks do (:func:`scan_file` with ingest_root's read, the Parquet write), under
    cProfile: (part, seconds) for opening + metadata, decompression, uproot's interpretation,
    the Arrow build, casting to the schema and the Parquet encoding; and the wall time unprofiled."""
    import pyarrow.parquet as pq

    from pipeline.ingest.root import (PARQUET_WRITE_OPTIONS, FilePlanning, arrow_schema, conform, convert_range,
                                      open_tree, scan_file)
    from pipeline.ingest.root.baskets import basket_maps
    from pipeline.ingest.root.trees import read_arrow_mapped

    files = case.files[:limit_files]
    schema = arrow_schema(open_tree(files[0], case.tree), case.branches)
    planning = FilePlanning(case.tree, case.branches, "100 MB", case.filt)
    read = convert_range(case.branches, schema)

    def describe(t, ranges):
        return basket_maps(t, case.branches, ranges)

    def work():
        for f in files:
            s = scan_file(f, planning, read, describe)
            if s.error:
                raise RuntimeError(s.error)
            if s.done:
                pq.write_table(s.data, io.BytesIO(), **PARQUET_WRITE_OPTIONS)
            else:                                            # the second pass: each chunk from its basket map
                for (a, b), m in zip(s.ranges, s.notes):
                    table = conform(read_arrow_mapped(f, case.tree, case.branches, a, b, m), schema)
                    pq.write_table(table, io.BytesIO(), **PARQUET_WRITE_OPTIONS)

    work()                                                       # warm: imports, interpretation plans
    t0 = time.perf_counter()
    work()
    wall = time.perf_counter() - t0
    prof = cProfile.Profile()
    prof.runcall(work)
    st = pstats.Stats(prof).stats

    def cum(path_end: str, func: str) -> float:
        return sum(v[3] for (fn, _, name), v in st.items() if fn.endswith(path_end) and name == func)

    total = cum("bench/ingest.py", "work")
    plan = cum("ingest/root/planning.py", "plan_file") + cum("ingest/root/baskets.py", "basket_maps")
    nested = sum(ct for (fn, _, name), v in st.items() if fn.endswith("ingest/root/trees.py") and name == "read_arrow"
                 for (caller, _, cname), (_, _, _, ct) in v[4].items() if cname == "read_arrow_mapped")
    reading = cum("ingest/root/trees.py", "read_arrow") + cum("ingest/root/trees.py", "read_arrow_mapped") - nested
    uproot_arrays = cum("uproot/behaviors/TBranch.py", "arrays")
    decomp = sum(ct for (fn, _, name), v in st.items() if fn.endswith("uproot/compression.py") and name == "decompress"
                 for (caller, *_), (_, _, _, ct) in v[4].items() if caller.endswith("models/TBasket.py"))
    # (the TTree's own key is decompressed too, while opening: that stays in the first row)
    direct_inflate = cum("ingest/root/baskets.py", "_inflate")
    direct = sum(cum("ingest/root/baskets.py", f) for f in ("read_flat", "read_jagged", "read_mapped"))
    casting = cum("ingest/root/schema.py", "conform")
    parquet = max([v[3] for (fn, _, name), v in st.items()               # the function, not the writer's method
                   if fn.endswith("pyarrow/parquet/core.py") and name == "write_table"] or [0.0])
    rows = [("open file + TTree metadata + plan (+ basket maps)", plan),
            ("decompression (ZLIB baskets)", decomp + direct_inflate),
            ("interpretation (uproot's, less decompression)", uproot_arrays - decomp),
            ("baskets read directly, less decompression", direct - direct_inflate),
            ("Arrow build (NumPy/awkward -> Arrow)", reading - uproot_arrays - direct),
            ("cast to the run's schema", casting), ("Parquet encoding (snappy)", parquet)]
    rows.append(("other", total - sum(v for _, v in rows)))
    return [(k, v / total * wall) for k, v in rows] + [("total, one process, unprofiled", wall)]


def ab_steps(case: Case, rounds: int = 3, limit_files: int = 5, max_entries: int = 5000) -> list[tuple[str, float]]:
    """Each change of the read measured in one process on (up to ``limit_files`` of) the case's
    files, cumulatively, in rotating order over ``rounds`` rounds: (step, median seconds for the
    files: open, read all branches of up to ``max_entries`` entries as Arrow, Parquet write to
    memory)."""
    import pyarrow.parquet as pq

    from pipeline.ingest.root import PARQUET_WRITE_OPTIONS, open_tree, read_arrays, read_arrow, to_arrow
    from pipeline.ingest.uproot_adapter import memoize_classnames, reuse_interpretations, use_fast_zlib

    files = case.files[:limit_files]

    def old(t, plans):
        return to_arrow(read_arrays(t, case.branches, 0, min(t.num_entries, max_entries)))

    def reuse(t, plans):
        reuse_interpretations(t, case.branches, plans)
        return old(t, plans)

    def numpy(t, plans):
        return read_arrow(t, case.branches, 0, min(t.num_entries, max_entries), direct=False)

    def baskets(t, plans):
        return read_arrow(t, case.branches, 0, min(t.num_entries, max_entries))

    steps = [("uproot -> awkward -> Arrow, zlib (before)", old, False, False),
             ("+ ISA-L decompression", old, True, False),
             ("+ interpretations reused across files", reuse, True, False),
             ("+ flat branches NumPy -> Arrow (uproot's np)", numpy, True, False),
             ("+ class names regularised once", numpy, True, True),
             ("+ flat and jagged branches from their baskets", baskets, True, True)]
    secs: dict[str, list[float]] = {s[0]: [] for s in steps}
    try:
        for r in range(rounds):
            for name, fn, isal, memo in steps[r % len(steps):] + steps[:r % len(steps)]:
                use_fast_zlib(isal)
                memoize_classnames(memo)
                plans: dict = {}
                fn(open_tree(files[0], case.tree), plans)             # the plans of a first file
                t0 = time.perf_counter()
                for f in files:
                    pq.write_table(fn(open_tree(f, case.tree), plans), io.BytesIO(), **PARQUET_WRITE_OPTIONS)
                secs[name].append(time.perf_counter() - t0)
    finally:
        use_fast_zlib()
        memoize_classnames()
    return [(name, statistics.median(v)) for name, v in secs.items()]


def spark_convert(spark, case: Case, out: Path, schemas: Path, files=None) -> tuple[float, int]:
    """``ingest_root`` of the case's files (driver planning and schema read included); (seconds,
    Parquet bytes)."""
    from pipeline.ingest.root import IngestRootConfig, ingest_root

    files = files or case.files
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):          # its per-file lines
        rep = ingest_root(IngestRootConfig(input=files, tree=case.tree, filter_name=case.filt, output=str(out),
                                           schema_dir=str(schemas)), spark=spark)
    seconds = time.perf_counter() - t0
    if rep["rows"] != case.events * len(files) // len(case.files) or rep["bad_files"]:
        raise RuntimeError(f"ingest_root wrote {rep['rows']} rows, bad files {rep['bad_files'][:1]}")
    return seconds, _bytes(out)


def _median_line(what: str, vals: list[float], target: float | None = None) -> str:
    med = statistics.median(vals)
    verdict = "" if target is None else f" (target >= {target}: {'PASS' if med >= target else 'FAIL'})"
    return f"{what}: median of {len(vals)} round(s) {med:.2f}{verdict}; rounds {', '.join(f'{v:.2f}' for v in vals)}"


def converter_rounds(args, spark, case: Case, work: Path, limit: dict | None = None) -> list[str]:
    """bare, hepconvert and ingest_root in rotating order on one case; the summary lines."""
    work = work / case.name
    peers = {"bare": Peer("bare", bare_convert, case, work)}
    if case.hepconvert:
        peers["hepconvert"] = Peer("hepconvert", hepconvert_convert, case, work)
    spark_convert(spark, case, work / "warm", work / "schemas", files=case.files[:args.cores])
    sides = [*peers, "ingest_root"]
    ratios: dict[str, list[float]] = {"bare": [], "hepconvert": [], "limit": [], "size": []}
    try:
        for r in range(args.repeat):
            secs, size = {}, {}
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                secs[side], size[side] = (spark_convert(spark, case, work / "spark", work / "schemas")
                                          if side == "ingest_root" else peers[side].run())
            rate = {k: case.mb / v for k, v in secs.items()}
            ratios["bare"].append(rate["ingest_root"] / args.cores / rate["bare"])
            line = " | ".join(f"{k} {secs[k]:6.1f} s {rate[k]:6.2f} MB/s {size[k] / 1e6:6.1f} MB out" for k in sides)
            if "hepconvert" in rate:
                ratios["hepconvert"].append(rate["ingest_root"] / (args.cores * rate["hepconvert"]))
                ratios["size"].append(size["ingest_root"] / size["hepconvert"])
                line += f" | per core / hepconvert {ratios['hepconvert'][-1]:.2f}"
            if limit:
                ratios["limit"].append(rate["ingest_root"] / args.cores / (limit["mb"] / limit[limit["library"]]))
                line += f" | MB/s per core / decompression limit {ratios['limit'][-1]:.2f}"
            print(f"{case.name} round {r + 1} (load {os.getloadavg()[0]:.1f}): {line}", flush=True)
    finally:
        for p in peers.values():
            p.close()
    targets = {"nano-small": (1.5, None), "nano-large": (1.2, 0.5), "delphes": (0.9, None)}[case.name]
    out = [_median_line(f"{case.name}: ingest_root per core / bare", ratios["bare"],
                        0.7 if case.name == "delphes" else None)]
    if ratios["hepconvert"]:
        out.append(_median_line(f"{case.name}: ingest_root local[{args.cores}] / ({args.cores} x hepconvert single "
                                "process) = per core ratio", ratios["hepconvert"], targets[0]))
        out.append(_median_line(f"{case.name}: ingest_root Parquet bytes / hepconvert's", ratios["size"]))
    else:
        out.append(f"{case.name}: hepconvert not run with --branches config (it cannot select Delphes split-branch "
                   "names); its target is measured on all branches: --branches all")
    if ratios["limit"]:
        out.append(_median_line(f"{case.name}: ingest_root MB/s per core / decompression limit "
                                f"({limit['mb'] / limit[limit['library']]:.1f} MB/s on disk, {limit['library']})",
                                ratios["limit"], targets[1]))
    return out


def remote_rounds(args, spark, case: Case, src: Path, work: Path) -> list[str]:
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
        rcase = Case("delphes", remote, case.tree, case.events, case.mb, case.filt, case.branches)
        lcase = Case("delphes", local, case.tree, case.events, case.mb, case.filt, case.branches)
        spark_convert(spark, rcase, work / "remote-warm", work / "schemas", files=remote[:args.cores])
        for r in range(args.repeat):
            order = [("local", lcase), ("root://", rcase)]
            for name, c in order if r % 2 == 0 else order[::-1]:
                rates[name].append(case.mb / spark_convert(spark, c, work / "remote-out", work / "schemas")[0])
            print(f"remote round {r + 1} (load {os.getloadavg()[0]:.1f}): ingest_root local "
                  f"{rates['local'][-1]:5.2f} MB/s | root:// {rates['root://'][-1]:5.2f} MB/s", flush=True)
    return [f"ingest_root local[{args.cores}] over root:// (loopback xrootd): median {statistics.median(rates['root://']):.2f}"
            f" MB/s, local files {statistics.median(rates['local']):.2f} MB/s",
            _median_line("root:// / local", [a / b for a, b in zip(rates["root://"], rates["local"])])]


def _print_profile(case: Case, limit: dict) -> None:
    rows = profile_split(case)
    total = rows[-1][1]
    n = min(len(case.files), 20)
    print(f"profile, {case.name}: {n} file(s) in one process, {case.mb * n / len(case.files):.1f} MB on disk "
          f"(load {os.getloadavg()[0]:.1f})")
    for k, v in rows[:-1]:
        print(f"  {k:46s} {v:7.2f} s {100 * v / total:5.1f} %")
    print(f"  {rows[-1][0]:46s} {total:7.2f} s  = {case.mb * n / len(case.files) / total:.1f} MB/s on disk")
    print(f"  anchor: decompressing the same files' ZLIB blocks, one process: zlib "
          f"{limit['mb'] / limit['zlib']:.1f} MB/s, {limit['library']} {limit['mb'] / limit[limit['library']]:.1f} "
          f"MB/s on disk ({limit['uncompressed_mb'] / limit['mb']:.1f}x uncompressed)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=["nano", "nano-small", "nano-large", "delphes", "all"], default="nano",
                    help="nano: nano-small and nano-large")
    ap.add_argument("--nano-copies", type=int, default=20, help="copies of nano_dy.root (345 KB each)")
    ap.add_argument("--large-events", type=int, default=100000,
                    help="events of the generated large NanoAOD file (20,000 and fewer: one 100 MB chunk)")
    ap.add_argument("--profile", action="store_true", help="print where one process's time goes (NanoAOD cases)")
    ap.add_argument("--ab", action="store_true", help="print each change of the read, measured in one process")
    ap.add_argument("--no-rounds", action="store_true", help="only --profile / --ab (no Spark, no peers)")
    ap.add_argument("--copies", type=int, default=8, help="copies of delphes.root (5.4 MB each)")
    ap.add_argument("--cores", type=int, default=2, help="Spark local[N]")
    ap.add_argument("--branches", choices=["all", "config"], default="all", help="delphes case")
    ap.add_argument("--repeat", type=int, default=3, help="rounds in rotating order (median reported)")
    ap.add_argument("--no-remote", action="store_true", help="skip the root:// row (delphes case)")
    ap.add_argument("--small", action="store_true", help="smoke check: 2 copies, 1 round, 2,000 large events")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.small:
        args.copies, args.nano_copies, args.large_events, args.repeat = 2, 2, 2000, 1
    if min(args.copies, args.nano_copies) < args.cores or args.repeat < 1:
        ap.error("--copies and --nano-copies must be >= --cores and --repeat >= 1")

    import logging

    import yaml

    from pipeline.cli import setup_logging
    from pipeline.config import SparkConfig
    from pipeline.ingest.root import plan_chunks
    from pipeline.samples import coffea_samples, data_cache
    from pipeline.spark import get_spark

    setup_logging()
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    t_start = time.perf_counter()
    samples = coffea_samples()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-ingest-"))
    wanted = {"nano": ["nano-small", "nano-large"], "all": ["nano-small", "nano-large", "delphes"]}.get(
        args.case, [args.case])
    cases = []
    for name in wanted:
        if name == "delphes":
            src = samples / "delphes.root"
            files = symlink_copies(src, work / "input", "delphes", args.copies)
            filt = ["*"] if args.branches == "all" else yaml.safe_load(
                (REPO / "configs" / "ingest_root.yaml").read_text())["filter_name"]
            tree, events, hep = "Delphes", 25 * args.copies, args.branches == "all"
        elif name == "nano-small":
            src = samples / "nano_dy.root"
            files, filt, tree, events, hep = (symlink_copies(src, work / "input", "nano_dy", args.nano_copies), ["*"],
                                              "Events", 40 * args.nano_copies, True)
        else:
            src = large_nanoaod(samples / "nano_dy.root", args.large_events, data_cache() / "bench-ingest")
            files, filt, tree, events, hep = [str(src)], ["*"], "Events", args.large_events, True
        branches = plan_chunks([str(src)], tree, filt, progress=False).branches
        cases.append(Case(name, files, tree, events, len(files) * src.stat().st_size / 1e6, filt, branches, hep))
        print(f"input {name}: {len(files)} file(s) = {cases[-1].mb:.1f} MB on disk, {events} events, "
              f"{len(branches)} branches; Spark local[{args.cores}]; {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
    limits = {c.name: decompress_limit(c.files, c.tree) for c in cases if c.name != "delphes"}
    for c in cases:
        if args.profile and c.name in limits:
            _print_profile(c, limits[c.name])
        if args.ab and c.name in limits:
            print(f"changes of the read, {c.name}, one process, median of 3 rotating rounds "
                  f"(load {os.getloadavg()[0]:.1f}):")
            base = None
            for name, sec in ab_steps(c):
                base = base or sec
                print(f"  {name:46s} {sec:7.2f} s  {base / sec:5.2f}x", flush=True)
    if args.no_rounds:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    spark = get_spark(SparkConfig(master=f"local[{args.cores}]", app_name="bench-ingest", driver_memory="4g"))
    summary = []
    try:
        for c in cases:
            summary += converter_rounds(args, spark, c, work, limits.get(c.name))
            if c.name == "delphes" and not args.no_remote:
                summary += remote_rounds(args, spark, c, samples / "delphes.root", work)
    finally:
        spark.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(summary))
    print(f"bench/ingest.py: {time.perf_counter() - t_start:.0f} s, load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
