"""bench/cluster_model_fidelity.py: its options, its model side against the cost model's own
formulas, and (slow tier) its smallest shaped case end to end: real processes in a network
namespace whose loopback a token bucket shapes. The fidelity figures themselves are a benchmark
(docs/benchmarks.md), never asserted here."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "cluster_model_fidelity.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench():
    return _load("cluster_model_fidelity", SCRIPT)


def _model():
    """The bench's model side (bench/fidelity_model.py)."""
    return _load("fidelity_model", REPO / "bench" / "fidelity_model.py")


@pytest.mark.parametrize("argv, says", [
    (["--steps", "20", "--unshaped"], "--steps=20: must be a multiple of 16"),
    (["--repeats", "0", "--unshaped"], "--repeats=0: must be >= 1"),
    (["--latency-us", "-5", "--unshaped"], "--latency-us=-5.0: must be >= 0"),
    (["--hlf-manifest", "/nonexistent/manifest.json", "--unshaped"], "--hlf-manifest /nonexistent/manifest.json"),
])
def test_a_bad_option_is_one_line_and_exit_2_before_any_run(argv, says, capsys):
    rc = _bench().main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("argv, says", [
    (["--algorithms", "arsgd,sgdx"], "sgdx: not one of"),
    (["--models", "resnet"], "resnet: not one of"),
    (["--rates", "10,fast"], "expected numbers"),
    (["--rates", "0"], "rates must be > 0"),
])
def test_argparse_refuses_unknown_names_and_rates(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().parser().parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_options_parse_to_the_documented_defaults():
    a = _bench().parser().parse_args([])
    assert (a.rates, a.algorithms, a.models, a.repeats, a.steps, a.hlf_steps, a.overlap, a.burst) == (
        [10.0, 100.0, 1000.0], ["arsgd", "local_sgd", "swarm", "adpsgd"], ["lenet5", "hlf"], 3, 32, 2048, "split", True)


def test_one_bucket_for_both_directions_is_the_ring_at_half_the_rate():
    """At M = 2 both ranks send at once in each ring step, through the one token bucket: the cost
    model's ring allreduce over a link of half the rate (its own formula, 2(M-1)/M n / beta)."""
    from pipeline.train.comm.costmodel import Cluster, Link

    b = _model()
    rate, n = 1.25e6, 246_824.0
    half = Cluster(nodes=2, ranks_per_node=1, inter=Link(0.0, rate / 2), intra=Link(0.0, rate))
    ring = [[n / 2, n / 2], [n / 2, n / 2]]          # 2(M-1) phases, every rank sending n / M
    assert b.bucket_seconds(ring, rate) == pytest.approx(half.ring_allreduce([0, 1], n).seconds, rel=1e-9)
    assert b.bucket_seconds(ring, rate) == pytest.approx(2 * n / rate, rel=1e-9)
    # an exchange (both directions at once) and a request then a reply both put 2n through the bucket
    assert b.bucket_seconds([[n, n]], rate) == pytest.approx(2 * n / rate, rel=1e-9)
    assert b.bucket_seconds([[n], [n]], rate) == pytest.approx(2 * n / rate, rel=1e-9)
    assert b.bucket_seconds([[n], [n]], rate, latency_s=0.01) == pytest.approx(2 * n / rate + 0.02, rel=1e-9)


def test_a_gloo_message_on_the_wire_is_its_frames_its_acks_its_preamble_and_two_notifications():
    """TCP at MTU 1500: 1448 payload bytes and 66 bytes of headers a frame, an ACK (66 B) every second
    frame; gloo: a 48-byte preamble before the payload and two notifications (one frame of 48 B each)."""
    b = _model()
    assert b.wire_bytes(1448) == 1448 + 66 + 66
    assert b.wire_bytes(1449) == 1449 + 2 * 66 + 66
    assert b.wire_bytes(5 * 1448) == 5 * 1448 + 5 * 66 + 3 * 66
    assert b.wire_bytes(48, acks=False) == 48 + 66
    assert b.gloo_message(2016) == (2064 + 2 * 66 + 66) + 2 * (48 + 66)          # 2,490 B
    # gloo's ring at M = 2 cuts 8,052 B into 4 segments of 2,016 (float32, rounded up): two per rank and phase
    assert b.ring_phases(8052) == [[2 * 2490, 2 * 2490], [2 * 2490, 2 * 2490]]
    # 246,824 B: segments of at most 1 MiB, still 4
    assert b.ring_phases(246_824)[0][0] == 2 * b.gloo_message(61_708)
    # 3 MiB: 3 segments by size, rounded up to a multiple of the ranks: 4
    assert b.ring_phases(3 * 2 ** 20)[0][0] == 2 * b.gloo_message(3 * 2 ** 20 / 4)
    assert b.exchange_phases(8052) == [[b.gloo_message(8052)] * 2]


def test_the_predicted_communication_per_step_of_each_algorithm():
    """Wire bytes (the test above) through the one bucket, no burst. AR-SGD, 1,000 B: 4 segments of 252 B,
    a message 300 + 66 + 66 + 228 = 660 B, each phase 2 ranks x 2 messages: 2 x 2,640 B. Local SGD,
    1,200 B (H = 8): segments of 300 B, messages of 708 B: 2 x 2,832 B an operation. SwarmSGD (H = 4):
    one message of 1,200 B each way, 1,248 + 66 + 66 + 228 = 1,608 B."""
    b = _model()
    rate, nb = 1e6, {"grads": 1000.0, "averaged": 1200.0}
    assert b.predicted_comm("arsgd", nb, 0.01, rate, burst=False)[0] == pytest.approx(2 * 2640 / rate)
    assert b.predicted_comm("local_sgd", nb, 0.01, rate, burst=False)[0] == pytest.approx(2 * 2832 / rate / 8)
    assert b.predicted_comm("swarm", nb, 0.01, rate, burst=False)[0] == pytest.approx(2 * 1608 / rate / 4)
    # a latency per phase: the ring's 2(M-1) = 2, the exchange's 1
    assert b.predicted_comm("arsgd", nb, 0.01, rate, 1e-3, burst=False)[0] == pytest.approx(2 * 2640 / rate + 2e-3)
    assert b.predicted_comm("swarm", nb, 0.01, rate, 1e-3, burst=False)[0] == pytest.approx((2 * 1608 / rate + 1e-3) / 4)


def test_adpsgd_waits_at_the_round_end_for_the_averaging_in_flight():
    """Steps of 1 s, averagings of 2.5 s, rounds of 4 steps: averagings start at 0 and 3 (at most one per
    step boundary, none while one is in flight), the second ends at 5.5, 1.5 s after the round's last
    step: 0.375 s of waiting and 0.5 averagings per step. Fast averagings: one per step, no wait."""
    b = _model()
    assert b.adpsgd_round(1.0, 2.5, 4) == (pytest.approx(0.375), pytest.approx(0.5))
    assert b.adpsgd_round(1.0, 0.1, 4) == (0.0, 1.0)


def test_the_bucket_holds_what_it_gathered_while_idle_up_to_its_depth_and_sends_that_at_once():
    """tbf refills at its rate while the link is idle, up to its depth (4,096 bytes on the wire); those
    bytes pass at once, the rest at the rate, shared by the flows."""
    b = _model()
    depth = 4096
    assert b.bucket_credit(1e6, 0.001) == pytest.approx(1000.0)
    assert b.bucket_credit(1e6, 1.0) == pytest.approx(depth)
    assert b.bucket_credit(1e6, -1.0) == 0.0
    n, rate = 8000.0, 1e6
    assert b.bucket_seconds([[n, n]], rate, credit=3000.0) == pytest.approx((2 * n - 3000) / rate)
    # a credit larger than the first phase: that phase takes no time, the rest comes off the second
    assert b.bucket_seconds([[n / 2, n / 2], [n / 2, n / 2]], rate, credit=n + 1000) == pytest.approx((n - 1000) / rate)
    # unequal flows: the credit is taken in equal parts, a flow never below zero
    assert b.bucket_seconds([[100.0, 5000.0]], rate, credit=1000.0) == pytest.approx(4100 / rate)


def test_with_the_burst_each_operation_starts_with_the_tokens_of_the_compute_before_it():
    """AR-SGD: the compute of one step refills the bucket; local SGD (H = 8): eight steps' compute. 8,000 B:
    segments of 2,000 B, messages of 2,048 + 2 x 66 + 66 + 228 = 2,474 B, 4 x 2 x 2,474 = 19,792 B an operation."""
    b = _model()
    rate, nb = 1e6, {"grads": 8000.0, "averaged": 8000.0}
    assert b.predicted_comm("arsgd", nb, 0.001, rate, burst=True)[0] == pytest.approx((19792 - 1000) / rate)
    assert b.predicted_comm("local_sgd", nb, 0.001, rate, burst=True)[0] == pytest.approx((19792 - 4096) / rate / 8)
    assert b.predicted_comm("arsgd", nb, 0.001, rate)[0] == b.predicted_comm("arsgd", nb, 0.001, rate, burst=True)[0]


def test_overlap_max_takes_the_longer_of_the_measured_communication_and_the_shaped_transfer():
    """The unshaped step 2 ms with 1.3 ms of communication: a shaped transfer of 1.6 ms gives 0.7 + 1.6 ms
    (``add`` would give 2 + 4.864 - the transfer at the fast rate); a transfer of 0.49 ms is hidden by the
    measured 1.3 ms: the unshaped step. 800 B: messages of 248 + 66 + 66 + 228 = 608 B, 4 x 2 x 608 = 4,864 B."""
    b = _model()
    nb = {"grads": 800.0, "averaged": 800.0}
    assert b.calibrated("arsgd", nb, 0.002, 0.0013, 1e6, 1e9, overlap="max", burst=False) == pytest.approx(0.0007 + 0.004864)
    assert b.calibrated("arsgd", nb, 0.002, 0.0013, 1e7, 1e9, overlap="max", burst=False) == pytest.approx(0.002)
    assert b.calibrated("arsgd", nb, 0.002, 0.0013, 1e6, 1e9, overlap="add", burst=False) == \
        pytest.approx(0.002 + 0.004864 - 4.864e-6)
    with pytest.raises(ValueError, match="overlap='sum'"):
        b.calibrated("arsgd", nb, 0.002, 0.0013, 1e6, 1e9, overlap="sum")


def test_split_adds_the_per_byte_part_of_the_measured_communication_and_hides_the_rest():
    """AR-SGD, 100,000 B of gradients, unshaped step 5 ms with 2 ms of communication, 10 ns a byte of it
    grows with the bytes (1 ms): the other 1 ms is hidden by a 4 ms transfer, the 1 ms is not: 3 + 1 + 4 ms.
    Local SGD (H = 8): the same per operation, spread over its 8 steps."""
    b = _model()
    nb = {"grads": 100_000.0, "averaged": 100_000.0}
    wire = b.bucket_seconds(b.ring_phases(100_000), 1.0)   # the ring's bytes on the wire through the bucket
    assert wire == 4 * 2 * (25_048 + 18 * 66 + 9 * 66 + 228)
    rate = wire / 0.004                             # ... in 4 ms
    kw = {"burst": False}
    assert b.calibrated("arsgd", nb, 0.005, 0.002, rate, 1e12, overlap="split", per_byte_s=1e-8, **kw) == pytest.approx(0.008)
    assert b.calibrated("arsgd", nb, 0.005, 0.002, rate, 1e12, overlap="max", **kw) == pytest.approx(0.007)
    # with no per-byte part, split is max; a per-byte part larger than the measured communication is capped by it
    assert b.calibrated("arsgd", nb, 0.005, 0.002, rate, 1e12, overlap="split", **kw) == pytest.approx(0.007)
    assert b.calibrated("arsgd", nb, 0.005, 0.002, rate, 1e12, overlap="split", per_byte_s=1e-6, **kw) == \
        pytest.approx(0.009)
    # local SGD: 0.25 ms of communication a step = 2 ms an operation, 1 ms of it per-byte, the transfer 4 ms
    assert b.calibrated("local_sgd", nb, 0.001, 0.00025, rate, 1e12, overlap="split", per_byte_s=1e-8, **kw) == \
        pytest.approx(0.00075 + (0.001 + 0.004) / 8)


def test_the_per_byte_cost_comes_from_two_models_baselines_of_the_same_algorithm():
    """Per operation: LeNet-5's 246,824 B took 2.3 ms, HLF's 8,052 B 1.1 ms: 1.2 ms over 238,772 B. For local
    SGD the per-step communication is multiplied by its H = 8 first. One model, or AD-PSGD: 0."""
    b = _model()
    nb = {"lenet5": {"grads": 246_824, "averaged": 246_824}, "hlf": {"grads": 8_052, "averaged": 8_052}}
    assert b.per_byte_cost("arsgd", {"lenet5": 0.0023, "hlf": 0.0011}, nb) == pytest.approx(0.0012 / 238_772)
    assert b.per_byte_cost("local_sgd", {"lenet5": 0.0023 / 8, "hlf": 0.0011 / 8}, nb) == pytest.approx(0.0012 / 238_772)
    assert b.per_byte_cost("arsgd", {"hlf": 0.0011}, nb) == 0.0
    assert b.per_byte_cost("arsgd", {"lenet5": 0.0010, "hlf": 0.0011}, nb) == 0.0
    assert b.per_byte_cost("adpsgd", {"lenet5": 0.0023, "hlf": 0.0011}, nb) == 0.0


def test_every_rule_is_counted_on_the_same_runs_and_scope():
    """Two shaped cases and their baselines: one in scope (communication 60 % of the step), one below."""
    b = _model()
    nb = {"hlf": {"grads": 800.0, "averaged": 800.0}}
    runs = [{"rate": 8.0, "model": "hlf", "algorithm": "arsgd", "step_s": 0.005, "comm_s": 0.0042},
            {"rate": "base", "model": "hlf", "algorithm": "arsgd", "step_s": 0.002, "comm_s": 0.0013},
            {"rate": 8.0, "model": "hlf", "algorithm": "swarm", "step_s": 0.002, "comm_s": 0.0001},
            {"rate": "base", "model": "hlf", "algorithm": "swarm", "step_s": 0.002, "comm_s": 0.0001}]
    counts = b.rule_counts(runs, nb, 1e9)
    # 8 Mbit/s = 1 MB/s on the wire; the ring's 4,864 B take 4.864 ms, less 0.7 ms of burst (the 0.7 ms of
    # compute refill 700 B): max 0.7 + 4.864 = 5.56 ms and 0.7 + 4.164 = 4.86 ms against 5: within; add
    # 2 + 4.864 and 2 + 4.164 ms (less ~0 at 1 GB/s): not
    assert counts[("max", False)] == (1, 1) and counts[("max", True)] == (1, 1)
    assert counts[("add", False)] == (0, 1) and counts[("add", True)] == (0, 1)
    assert counts[("split", False)] == counts[("max", False)]    # one model: no per-byte part


def _shaping_missing() -> str | None:
    if os.geteuid() != 0:
        return "shaping a namespace's loopback needs root"
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    return _bench().shaping_unavailable()


def test_the_baseline_prediction_is_the_unshaped_step_plus_what_the_slower_link_adds():
    """AR-SGD at M = 2 on 8,000 B of gradients: a ring of 2 phases, each 2 x 4,948 B on the wire through the
    one bucket, is 0.019792 s at 1 MB/s and 0.000019792 s at 1 GB/s; the prediction adds the difference to
    the measured unshaped step. AD-PSGD: the unshaped step without its waits, plus the modelled wait."""
    b = _model()
    nbytes = {"grads": 8000, "averaged": 8000}
    assert b.calibrated("arsgd", nbytes, 0.002, 0.0005, 1e6, 1e9, burst=False) == \
        pytest.approx(0.002 + 0.019792 - 0.000019792)
    step = 0.002 - 0.0004
    assert b.calibrated("adpsgd", nbytes, 0.002, 0.0004, 1e6, 1e9) == pytest.approx(
        step + b.predicted_comm("adpsgd", nbytes, step, 1e6)[0])


@pytest.mark.slow
def test_the_smallest_shaped_case_prints_its_pair_ratio_and_the_load(tmp_path):
    """The whole path: a namespace, its loopback shaped to 100 Mbit/s, 2 real worker processes (AR-SGD,
    HLF model, 16 steps), the compute profile and the prediction. Slow tier: the worker processes'
    start (the fork server imports torch) and their evaluations take 20-40 s of 2 shared cores, not
    cheaper while it is a real run."""
    why = _shaping_missing()
    assert not why, f"the fidelity bench needs a shaped link (root, unshare, tc and ip of iproute2): {why}"
    r = subprocess.run([sys.executable, str(SCRIPT), "--rates", "100", "--models", "hlf", "--algorithms", "arsgd", "--hlf-steps", "16",
                        "--repeats", "1", "--steps", "16", "--profile-repeats", "5", "--no-burst",
                        "--json", str(tmp_path / "out.json")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"^load average \(1, 5, 15 min\): before [\d.]+ ", r.stdout, re.M), r.stdout
    row = re.search(r"^\s+100 hlf\s+arsgd\s+([\d.]+)\s+[\d.]+%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+", r.stdout, re.M)
    assert row, r.stdout
    meas, comm, pred_comm, pred, ratio = map(float, row.groups())
    # the ratio is printed from the unrounded times, the times in ms to 2 decimals: within their rounding
    rounding = pred / meas * (0.005 / pred + 0.005 / meas) + 0.0005
    assert meas > 0 and pred > 0 and ratio == pytest.approx(pred / meas, abs=rounding)
    # 8,052 B of gradients through a 100 Mbit/s bucket (12.5 MB/s on the wire), both directions, no burst:
    # 4 segments of 2,016 B, each a gloo message of 2,490 B on the wire, 8 of them: 19,920 B
    assert pred_comm == pytest.approx(19_920 / 12.5e6 * 1e3, abs=0.01)
    assert re.search(r"^every rule on these runs \(in scope within the target\): --overlap add --no-burst \d of \d; "
                     r"--overlap add \d of \d;", r.stdout, re.M), r.stdout
    assert (tmp_path / "out.json").is_file()
