"""The model side of ``bench/cluster_model_fidelity.py``: the cases' settings, and what the cluster cost
model (``pipeline/train/comm/costmodel.py``) predicts for each on the shaped loopback, one token bucket
that every flow in both directions passes. The rules of the prediction are described in that script's
docstring and in docs/benchmarks.md (cluster cost model fidelity)."""
from __future__ import annotations

import math
import statistics
from typing import Optional

WORLD = 2
TARGET = 0.15          # |predicted / measured - 1| at most this ...
COMM_SCOPE = 0.30      # ... wherever communication is at least this share of the measured step
#: TCP over IPv4 at MTU 1500 with the timestamp option: 1448 payload bytes per segment, 66 bytes of headers per
#: frame on the loopback (14 Ethernet, 20 IP, 32 TCP with timestamps)
MSS = 1448
FRAME_HEADER = 66
#: the bucket's depth in bytes on the wire: the bench shapes with ``burst 32kbit``, which tc reads as 4096
#: bytes (`tc -d qdisc show` prints "burst 4Kb")
BURST_BYTES = 4096
#: gloo's tcp transport (gloo/transport/tcp/pair.cc): every message is preceded by its op preamble (six
#: size_t: 48 bytes); a send is written only once the receiver's "ready to receive" notification has arrived,
#: and the sender announces it with a "ready to send" one: two preamble-only messages per message
GLOO_PREAMBLE = 48
#: gloo's ring allreduce (gloo/allreduce.cc) cuts the buffer into segments of at most 1 MiB
#: (``kMaxSegmentSize``), at least two per rank, a multiple of the ranks
GLOO_SEGMENT_MAX = 1 << 20
#: AD-PSGD's request header (``P2PChannel.send_header``: four int64)
REQUEST_BYTES = 32
ROUND = 16             # AD-PSGD's round_steps; --steps is a multiple of it (and of H = 8 and SwarmSGD's 4)

#: algorithm -> (training config's algorithm section, optimizer settings are per model)
ALGORITHMS = {
    "arsgd": {"name": "arsgd"},
    "local_sgd": {"name": "local_sgd", "params": {"period": 8}},
    "swarm": {"name": "swarm", "params": {"local_steps": 4, "schedule": "fixed", "topology": "ring",
                                          "weighting": "equal"}},
    "adpsgd": {"name": "adpsgd", "params": {"pace": "step", "round_steps": ROUND, "timeout_s": 60}},
}
#: model -> its optimizer and rate (configs/train/lenet5.yaml, configs/train/hlf.yaml)
MODELS = {"lenet5": {"optimizer": "sgd", "lr": 0.02}, "hlf": {"optimizer": "adam", "lr": 0.001}}


def bucket_seconds(phases: list[list[float]], bytes_per_s: float, latency_s: float = 0.0,
                   credit: float = 0.0) -> float:
    """Seconds of an operation that runs as ``phases`` one after another, each a list of flows (bytes)
    that start together on ONE token bucket shared by every flow in both directions (the shaped
    loopback): a phase lasts until its last flow is done (``costmodel.fair_share_finish``). ``credit``:
    the payload bytes of tokens the bucket holds when the operation starts; they pass at once, taken
    from the first phases' flows in equal parts (:func:`bucket_credit`)."""
    from pipeline.train.comm.costmodel import fair_share_finish

    total, left = 0.0, max(0.0, float(credit))
    for ph in phases:
        if not ph:
            continue
        flows = [float(b) for b in ph]
        if left > 0:
            take = min(left, sum(flows))
            flows = _take_equally(flows, take)
            left -= take
        total += max(fair_share_finish(bytes_per_s, latency_s, [(0.0, b) for b in flows]))
    return total


def _take_equally(flows: list[float], amount: float) -> list[float]:
    """``flows`` less ``amount`` bytes in all, taken in equal parts (a flow never below 0)."""
    flows = list(flows)
    while amount > 1e-12:
        live = [i for i, b in enumerate(flows) if b > 0]
        if not live:
            break
        part = min(amount / len(live), min(flows[i] for i in live))
        for i in live:
            flows[i] -= part
        amount -= part * len(live)
    return flows


def bucket_credit(bytes_per_s: float, idle_s: float) -> float:
    """The bytes (on the wire) a token bucket of :data:`BURST_BYTES` holds after the link was idle ``idle_s``:
    it refills at the rate, up to its depth (tbf sends a packet at once while it has the tokens)."""
    return min(float(BURST_BYTES), bytes_per_s * max(0.0, idle_s))


def wire_bytes(payload: float, acks: bool = True) -> float:
    """Bytes on the wire of one TCP message of ``payload`` bytes: its frames (:data:`MSS` of payload each)
    with their headers and, with ``acks``, the receiver's ACK of every second frame (Linux's delayed ACK;
    on the loopback the ACKs pass the same bucket)."""
    frames = max(1, math.ceil(payload / MSS))
    return payload + frames * FRAME_HEADER + (math.ceil(frames / 2) * FRAME_HEADER if acks else 0.0)


def gloo_message(payload: float) -> float:
    """Wire bytes of one gloo message of ``payload`` bytes: its preamble and payload, and the two
    notifications that let it go (:data:`GLOO_PREAMBLE`; a notification is one frame, acknowledged with
    the next data)."""
    return wire_bytes(payload + GLOO_PREAMBLE) + 2 * wire_bytes(GLOO_PREAMBLE, acks=False)


def ring_phases(nbytes: float, m: int = WORLD) -> list[list[float]]:
    """gloo's ring allreduce of ``nbytes`` per rank (float32) in wire bytes: 2(M-1) phases (reduce-scatter,
    then allgather) in which every rank sends its share of the segments (:data:`GLOO_SEGMENT_MAX`) to its
    neighbour, each a gloo message (:func:`gloo_message`)."""
    segments = max(math.ceil(nbytes / GLOO_SEGMENT_MAX), 2 * m)
    segments = -(-segments // m) * m
    seg = math.ceil(nbytes / segments / 4) * 4
    return [[segments // m * gloo_message(seg)] * m for _ in range(2 * (m - 1))]


def exchange_phases(nbytes: float) -> list[list[float]]:
    """SwarmSGD's exchange: one gloo message each way at once (``batch_isend_irecv`` of one flat vector)."""
    return [[gloo_message(nbytes)] * WORLD]


def request_reply_phases(nbytes: float) -> list[list[float]]:
    """AD-PSGD's averaging: the request header and s_i one way, then s_j back (``P2PChannel``, gloo)."""
    return [[gloo_message(REQUEST_BYTES) + gloo_message(nbytes)], [gloo_message(nbytes)]]


def model_bytes(model_name: str, num_classes: int, shape: dict) -> dict:
    """Payload bytes: the gradients (AR-SGD) and the tensors parameter averaging moves (the
    parameters and BatchNorm buffers, ``policy`` defaults: batchnorm average, momentum local)."""
    from pipeline.train.algorithms.averaging import bn_buffers
    from pipeline.train.models import build_model

    m = build_model(model_name, num_classes, shape)
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    return {"grads": params, "averaged": params + sum(t.numel() * t.element_size() for t in bn_buffers(m))}


def predicted_comm(algo: str, nbytes: dict, compute_s: float, bytes_per_s: float,
                   latency_s: float = 0.0, burst: bool = True) -> tuple[float, float]:
    """(communication seconds per step on the training thread, AD-PSGD's averagings per step or nan) on a
    bucket of ``bytes_per_s`` on the wire (the line rate), every operation's wire bytes. ``burst``: each
    operation starts with the tokens the bucket gathered while the link was idle since the last one
    (:func:`bucket_credit`): the ``compute_s`` of the steps between two operations."""
    params = ALGORITHMS[algo].get("params", {})
    period = op_period(algo)
    credit = bucket_credit(bytes_per_s, compute_s * period) if burst else 0.0
    if algo == "arsgd":
        return bucket_seconds(ring_phases(nbytes["grads"]), bytes_per_s, latency_s, credit), float("nan")
    if algo == "local_sgd":
        return bucket_seconds(ring_phases(nbytes["averaged"]), bytes_per_s, latency_s, credit) / period, float("nan")
    if algo == "swarm":
        exchange = bucket_seconds(exchange_phases(nbytes["averaged"]), bytes_per_s, latency_s, credit)
        return exchange / period, float("nan")
    if algo == "adpsgd":    # on the communication thread (at most one a step): the wait at the round ends
        return adpsgd_round(compute_s, bucket_seconds(request_reply_phases(nbytes["averaged"]), bytes_per_s,
                                                      latency_s, credit), params["round_steps"])
    raise ValueError(f"unknown algorithm {algo!r}")


def op_period(algo: str) -> int:
    """Training steps per communication operation: local SGD's H, SwarmSGD's local steps, else 1."""
    params = ALGORITHMS[algo].get("params", {})
    return {"local_sgd": params.get("period", 1), "swarm": params.get("local_steps", 1)}.get(algo, 1)


def op_bytes(algo: str, nbytes: dict) -> float:
    """The payload of one operation: the gradients (AR-SGD), else the averaged tensors."""
    return float(nbytes["grads"] if algo == "arsgd" else nbytes["averaged"])


def calibrated(algo: str, nbytes: dict, base_step_s: float, base_comm_s: float, bytes_per_s: float,
               base_bytes_per_s: float, latency_s: float = 0.0, overlap: str = "add", burst: bool = True,
               per_byte_s: float = 0.0) -> float:
    """The predicted time per step from the unshaped baseline's measured step (compute, the loop's own work
    and every operation's fixed cost on this machine, measured as the compute profile is) and its measured
    communication ``base_comm_s``, with the shaped link's communication modelled at ``bytes_per_s``:

    * ``overlap="add"``: the baseline's step plus what the shaped link adds, the model's communication at
      ``bytes_per_s`` less its communication at the baseline's rate ``base_bytes_per_s``;
    * ``overlap="max"``: the baseline's step without its communication, plus the longer of its measured
      communication and the modelled transfer: the fixed cost of an operation on this machine (mostly the
      wait for the partner and for the threads to wake) passes while the bytes cross the slow link;
    * ``overlap="split"``: the baseline's communication per operation split into a part that grows with
      the bytes, ``per_byte_s`` a payload byte (copies through the kernel, the reduction: work the slow link
      does not hide), added to the transfer, and the rest, which the transfer hides as in ``max``. With
      ``per_byte_s`` 0 it is ``max``.

    ``burst``: the bucket's tokens after the compute between two operations (:func:`predicted_comm`).
    AD-PSGD: the baseline's step without its waits, and the wait at the round ends that the model predicts
    with the shaped exchange."""
    compute = base_step_s - base_comm_s
    if algo == "adpsgd":
        return compute + predicted_comm(algo, nbytes, compute, bytes_per_s, latency_s, burst)[0]
    shaped = predicted_comm(algo, nbytes, compute, bytes_per_s, latency_s, burst)[0]
    if overlap in ("max", "split"):     # max: split with no per-byte part
        period = op_period(algo)
        per_byte = max(0.0, per_byte_s) if overlap == "split" else 0.0
        byte_work = min(base_comm_s * period, per_byte * op_bytes(algo, nbytes))
        return compute + (byte_work + max(base_comm_s * period - byte_work, shaped * period)) / period
    if overlap != "add":
        raise ValueError(f"overlap={overlap!r}: expected add, max or split")
    return base_step_s + shaped - predicted_comm(algo, nbytes, compute, base_bytes_per_s, latency_s, burst)[0]


def per_byte_cost(algo: str, base: dict, nbytes: dict) -> float:
    """Seconds per payload byte of an operation's communication on this machine, from the unshaped baselines
    of two models with the same algorithm (``base``: model -> measured communication seconds per step): the
    difference of their communication per operation over the difference of their bytes (0 with fewer than
    two models, or where the larger message did not take longer)."""
    if algo == "adpsgd" or len(base) < 2:
        return 0.0
    pts = sorted((op_bytes(algo, nbytes[m]), c * op_period(algo)) for m, c in base.items())
    (n0, c0), (n1, c1) = pts[0], pts[-1]
    return max(0.0, (c1 - c0) / (n1 - n0)) if n1 > n0 else 0.0


def adpsgd_round(step_s: float, exchange_s: float, round_steps: int) -> tuple[float, float]:
    """AD-PSGD (pace ``step``) in one round of ``round_steps`` steps of ``step_s``: the active starts an
    averaging at a step boundary when none is in flight (at most one per step); at the round's end
    the training thread waits for the averaging in flight. Returns (that wait per step, averagings
    per step)."""
    free, started = 0.0, 0
    for k in range(round_steps):
        if free <= k * step_s:
            free, started = k * step_s + exchange_s, started + 1
    return max(0.0, free - round_steps * step_s) / round_steps, started / round_steps


def rule_counts(results: list[dict], nbytes: dict, base_bytes_per_s: float, latency_s: float = 0.0) -> dict:
    """Per rule ``(overlap, burst)``: (in-scope cases within the target, in-scope cases), from the runs'
    figures (``results``: the shaped cases and their unshaped baselines). The scope is the measured
    communication's share of the measured step, the same for every rule."""
    out = {}
    keys = sorted({(x["rate"], x["model"], x["algorithm"]) for x in results if x["rate"] != "base"},
                  key=lambda k: (k[0], k[1], k[2]))
    for overlap in ("add", "max", "split"):
        for burst in (False, True):
            ok = n = 0
            for rate, model, algo in keys:
                mine = [x for x in results if (x["rate"], x["model"], x["algorithm"]) == (rate, model, algo)]
                step = statistics.median(x["step_s"] for x in mine)
                pred = case_prediction(results, nbytes, rate, model, algo, base_bytes_per_s, latency_s, overlap, burst)
                if pred is None or statistics.median(x["comm_s"] for x in mine) < COMM_SCOPE * step:
                    continue
                n += 1
                ok += abs(pred / step - 1) <= TARGET
            out[(overlap, burst)] = (ok, n)
    return out


def case_prediction(results: list[dict], nbytes: dict, rate: float, model: str, algo: str, base_bytes_per_s: float,
                    latency_s: float = 0.0, overlap: str = "add", burst: bool = True) -> Optional[float]:
    """The predicted time per step of one shaped case (``rate`` Mbit/s on the wire) from its algorithm's
    unshaped baselines in ``results`` (:func:`calibrated`, with :func:`per_byte_cost` from every model's
    baseline); None where ``model`` has no baseline run."""
    bases = baselines(results, algo)
    if model not in bases:
        return None
    return calibrated(algo, nbytes[model], *bases[model], rate * 1e6 / 8, base_bytes_per_s, latency_s, overlap, burst,
                      per_byte_cost(algo, {m: v[1] for m, v in bases.items()}, nbytes))


def baselines(results: list[dict], algo: str) -> dict:
    """model -> (median step seconds, median communication seconds) of ``algo``'s unshaped baseline runs."""
    out = {}
    for m in sorted({x["model"] for x in results if x["rate"] == "base" and x["algorithm"] == algo}):
        runs = [x for x in results if x["rate"] == "base" and (x["model"], x["algorithm"]) == (m, algo)]
        out[m] = (statistics.median(x["step_s"] for x in runs), statistics.median(x["comm_s"] for x in runs))
    return out
