"""The cluster cost model (pipeline.train.comm.costmodel) and the ``cluster`` config section.

Every expected value is derived by hand in the comment above it from the formula the backend's
own source states (docs/training.md#the-cluster-cost-model), not computed by the code under test.
No Spark, no processes: the whole file runs in well under a second.
"""
from __future__ import annotations

import math

import pytest

from pipeline.config import build_config
from pipeline.errors import ConfigError
from pipeline.train.comm import costmodel
from pipeline.train.comm.compute_profile import ComputeProfile, measure_profile
from pipeline.train.comm.costmodel import PRESETS, Cluster, FlatCost, Ledger, Link, fair_share_finish
from pipeline.train.config import TrainConfig

FAST = Link(latency_s=1e-5, bytes_per_s=1e9)     # inside a node
SLOW = Link(latency_s=1e-3, bytes_per_s=1e6)     # between nodes


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------- allreduce
def test_ring_allreduce_on_one_node():
    c = Cluster(1, 4, inter=SLOW, intra=Link(1e-3, 1e6))
    # M = 4, alpha = 1 ms, beta = 1 MB/s, n = 4 MB: 2*3*1 ms + 2*3/4 * 4 MB / 1 MB/s = 0.006 + 6 s
    cost = c.ring_allreduce(range(4), 4e6)
    assert cost.seconds == approx(6.006)
    # each of the 4 hops carries 2*3/4 * 4 MB = 6 MB, all inside node 0
    assert cost.link_bytes == {"node0": approx(24e6)}


def test_ring_allreduce_across_nodes_counts_inter_node_latencies_and_the_slowest_hop():
    c = Cluster(2, 2, inter=SLOW, intra=FAST)
    # M = 4 on N = 2 nodes: latencies 2*((4-2)*10 us + (2-1)*1 ms) = 2.04 ms;
    # bytes 2*3/4 * 1 MB = 1.5 MB over the 1 MB/s hop between nodes = 1.5 s
    cost = c.ring_allreduce([0, 1, 2, 3], 1e6)
    assert cost.seconds == approx(1.5 + 2.04e-3)
    assert cost.link_bytes == {"node0": approx(1.5e6), "node0->node1": approx(1.5e6),
                               "node1": approx(1.5e6), "node1->node0": approx(1.5e6)}


def test_ring_allreduce_one_rank_per_node_is_the_textbook_formula():
    c = Cluster(4, 1, inter=SLOW, intra=FAST)
    # 2(M-1) latencies + 2(M-1)/M of the bytes: 6 * 1 ms + 1.5 * 2 MB / 1 MB/s = 3.006 s
    assert c.ring_allreduce(range(4), 2e6).seconds == approx(3.006)
    assert c.ring_allreduce([2], 2e6).seconds == 0.0          # a group of one sends nothing


def test_hierarchical_allreduce_composes_intra_and_inter_node_phases():
    c = Cluster(2, 4, inter=SLOW, intra=Link(1e-5, 1e8))
    # P = 4 ranks per node, N = 2 nodes, n = 8 MB.
    # inside: reduce-scatter + allgather = 2*(3*10 us + 3/4 * 8 MB / 100 MB/s) = 2*(3e-5 + 0.06) = 0.12006 s
    # across: 4 concurrent allreduces of 2 MB share each node's interface:
    #         2*1*1 ms + 2*1/2 * 2 MB * 4 / 1 MB/s = 0.002 + 8 = 8.002 s
    h = c.hierarchical_allreduce(range(8), 8e6)
    assert h.seconds == approx(0.12006 + 8.002)
    # the flat ring over the same 8 ranks: 2*((8-2)*10 us + 1 ms) + 2*7/8 * 8 MB / 1 MB/s = 0.00212 + 14 s
    ring = c.ring_allreduce(range(8), 8e6)
    assert ring.seconds == approx(14.00212)
    # inter-node bytes: each node sends 2*(2-1)/2 * 8 MB = 8 MB to the other (ring: 14 MB)
    assert h.link_bytes["node0->node1"] == approx(8e6) and ring.link_bytes["node0->node1"] == approx(14e6)
    # one node: hierarchical is the ring
    one = Cluster(1, 4, inter=SLOW, intra=FAST)
    assert one.hierarchical_allreduce(range(4), 1e6).seconds == one.ring_allreduce(range(4), 1e6).seconds


def test_nccl_auto_picks_tree_for_small_and_ring_for_large_messages():
    c = Cluster(4, 2, inter=Link(1e-5, 1e9), intra=Link(1e-6, 1e10), backend="nccl")
    # tree, n = 1 kB: 2*((2-1)*1 us + log2(4)*10 us) + 2 * 1 kB / 1 GB/s = 42 us + 2 us = 44 us
    # ring, n = 1 kB: 2*((8-4)*1 us + 3*10 us) + 2*7/8 * 1 kB / 1 GB/s = 68 us + 1.75 us = 69.75 us
    assert c.tree_allreduce(range(8), 1e3).seconds == approx(44e-6)
    assert c.ring_allreduce(range(8), 1e3).seconds == approx(69.75e-6)
    assert c.allreduce(range(8), 1e3).seconds == approx(44e-6)
    # n = 1 GB: tree 42 us + 2 s; ring 68 us + 1.75 s -> the ring
    assert c.allreduce(range(8), 1e9).seconds == approx(1.75 + 68e-6)
    # gloo has no tree: auto is the ring, and tree is refused
    g = Cluster(4, 2, inter=Link(1e-5, 1e9), intra=Link(1e-6, 1e10), backend="gloo")
    assert g.allreduce(range(8), 1e3).seconds == approx(69.75e-6)
    with pytest.raises(ValueError, match="tree"):
        Cluster(4, 2, inter=SLOW, intra=FAST, backend="gloo", allreduce_algorithm="tree")


# ---------------------------------------------------------------------- broadcast, gathers, messages
def test_gloo_broadcast_is_a_binomial_tree_whose_rounds_share_the_interface():
    c = Cluster(2, 2, inter=SLOW, intra=FAST)
    # root 0, n = 1 MB. round 0: 0 -> 1 inside node 0: 10 us + 1 ms = 1.01 ms.
    # round 1: 0 -> 2 and 1 -> 3 both leave node 0 at once: 1 ms + 2 * 1 MB / 1 MB/s = 2.001 s
    assert c.broadcast(range(4), 1e6, root=0).seconds == approx(1.01e-3 + 2.001)
    # root 1: round 0: 1 -> 2 across (1.001 s); round 1: 1 -> 3 (node 0 -> 1) and 2 -> 0 (node 1 -> 0),
    # one flow each way: 1.001 s
    assert c.broadcast(range(4), 1e6, root=1).seconds == approx(2.002)
    # M = 5 on one node: ceil(log2 5) = 3 rounds of alpha + n / beta
    one = Cluster(1, 5, inter=SLOW, intra=Link(1e-3, 1e6))
    assert one.broadcast(range(5), 1e6, root=0).seconds == approx(3 * 1.001)


def test_nccl_broadcast_is_a_pipelined_chain():
    c = Cluster(2, 2, inter=SLOW, intra=FAST, backend="nccl")
    # chain 0 -> 1 -> 2 -> 3: (4-2)*10 us + 1 ms latency, 1 MB once over the slowest hop (1 s)
    assert c.broadcast(range(4), 1e6, root=0).seconds == approx(1.00102)


def test_allgather_gather_and_point_to_point():
    c = Cluster(2, 2, inter=SLOW, intra=FAST)
    # allgather ring, 1 MB each: (4-2)*10 us + 1 ms + 3 * 1 MB / 1 MB/s = 3.00102 s
    assert c.allgather(range(4), 1e6).seconds == approx(3.00102)
    # gather to rank 0: ranks 2 and 3 send through node 1's interface at once: 1 ms + 2 * 1 s;
    # rank 1 inside node 0 is faster
    g = c.gather(range(4), 1e6, root=0)
    assert g.seconds == approx(2.001)
    assert g.link_bytes == {"node0": approx(1e6), "node1->node0": approx(2e6)}
    # messages: latency + bytes / bandwidth of the link between the two ranks
    assert c.p2p(0, 1, 1e6).seconds == approx(1e-5 + 1e-3)
    assert c.p2p(1, 2, 1e6).seconds == approx(1.001)
    assert c.p2p(1, 2, 1e6, flows=3).seconds == approx(3.001)      # three flows share the interface
    assert c.p2p(3, 0, 5e5).link_bytes == {"node1->node0": approx(5e5)}
    # a message 1 -> 2 while 0 -> 2 and 1 -> 3 cross from node 0 to node 1 and 0 -> 1 stays inside
    # node 0: three flows leave node 0 (and enter node 1) at once
    assert c.concurrent(1, 2, [(0, 2), (1, 3), (0, 1)]) == 3
    assert c.concurrent(2, 0, [(0, 2), (1, 3)]) == 1 and c.concurrent(0, 1, [(0, 2)]) == 1
    # barrier: the latencies of a zero-byte ring allreduce, 2*((4-2)*10 us + 1 ms)
    assert c.barrier(range(4)).seconds == approx(2.04e-3)


def test_concurrent_flows_share_a_link_by_processor_sharing():
    # two 1 MB flows at once on 1 MB/s: each gets half, both end at 2 s
    assert fair_share_finish(1e6, 0.0, [(0.0, 1e6), (0.0, 1e6)]) == [approx(2.0), approx(2.0)]
    # the second starts at 0.5 s: flow A has 0.5 MB left, both at 0.5 MB/s -> A ends at 1.5 s;
    # B has 0.5 MB left then, alone at 1 MB/s -> 2.0 s
    assert fair_share_finish(1e6, 0.0, [(0.0, 1e6), (0.5, 1e6)]) == [approx(1.5), approx(2.0)]
    # no overlap: each alone, plus the latency
    assert fair_share_finish(1e6, 0.1, [(3.0, 1e6), (0.0, 1e6)]) == [approx(4.1), approx(1.1)]
    # three flows of 1, 2, 3 MB at once: all at 1/3 MB/s until 3 s (first done), then two at 1/2 until
    # 5 s (second done: 2 - 1 = 1 MB more), then the last 1 MB alone: 6 s
    assert fair_share_finish(1e6, 0.0, [(0, 1e6), (0, 2e6), (0, 3e6)]) == [approx(3.0), approx(5.0), approx(6.0)]


def test_empty_flows_end_at_their_start_plus_the_latency():
    """Zero-byte flows (a message with nothing left to send) are done when they start, alone or last."""
    assert fair_share_finish(1e6, 0.1, [(0.0, 0.0), (0.5, 0.0)]) == [approx(0.1), approx(0.6)]
    assert fair_share_finish(1e6, 0.0, [(0.0, 1e6), (2.0, 0.0)]) == [approx(1.0), approx(2.0)]
    assert fair_share_finish(1e6, 0.0, []) == []


# ---------------------------------------------------------------------- presets and validation
def test_presets_are_valid_ordered_and_cite_their_sources():
    assert set(PRESETS) == {"gbe1", "gbe10", "ib100", "nvlink"}
    for p in PRESETS.values():
        for link in (p.inter, p.intra):
            assert math.isfinite(link.latency_s) and link.latency_s > 0
            assert math.isfinite(link.bytes_per_s) and link.bytes_per_s > 0
        assert len(p.source) > 40
    # 1 and 10 Gbit/s Ethernet carry 1460 of every 1538 bytes on the wire as TCP payload
    assert PRESETS["gbe1"].inter.bytes_per_s == approx(125e6 * 1460 / 1538)
    assert PRESETS["gbe10"].inter.bytes_per_s == approx(1.25e9 * 1460 / 1538)
    assert PRESETS["ib100"].inter.bytes_per_s == approx(12.5e9)
    bw = [PRESETS[k].inter.bytes_per_s for k in ("gbe1", "gbe10", "ib100")]
    assert bw == sorted(bw) and PRESETS["nvlink"].intra.bytes_per_s > PRESETS["nvlink"].inter.bytes_per_s
    c = Cluster.from_preset("gbe10", nodes=4, ranks_per_node=4)
    assert c.size == 16 and c.node_of(5) == 1 and c.link(5, 6) is c.intra and c.link(3, 4) is c.inter
    with pytest.raises(ValueError, match="unknown cluster preset 'gbe5'"):
        costmodel.preset("gbe5")


@pytest.mark.parametrize("make,match", [
    (lambda: Link(-1e-3, 1e6), "latency_s"),
    (lambda: Link(1e-3, 0.0), "bytes_per_s"),
    (lambda: Link(1e-3, float("nan")), "bytes_per_s"),
    (lambda: Cluster(0, 2, SLOW, FAST), "nodes"),
    (lambda: Cluster(1, 2, SLOW, FAST, backend="mpi"), "backend"),
    (lambda: Cluster(1, 2, SLOW, FAST).node_of(2), "rank 2 outside"),
    (lambda: Cluster(1, 2, SLOW, FAST).broadcast([0, 1], 8, root=5), "root 5"),
    (lambda: ComputeProfile({}, "x"), "at least one"),
    (lambda: ComputeProfile({8: 0.01}, " "), "source"),
])
def test_bad_model_values_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------------- today's model is the default
def test_default_config_keeps_the_flat_model_of_the_clock():
    from pipeline.train.comm.simcore import Simulation

    cfg = TrainConfig()
    assert not cfg.cluster.enabled and cfg.cluster.resolve(16) is None
    clk = cfg.simulated_clock.model_copy(update={"step_s": 0.01})
    flat = FlatCost(clk.latency_s, clk.bytes_per_s)
    sim = Simulation(clk, seed=0)
    for n in (0, 1, 4096, 10 ** 7):          # what the clock charged before the cluster model
        assert flat.allreduce(range(4), n).seconds == sim.transfer_seconds(n)
        assert flat.p2p(0, 1, n).seconds == sim.transfer_seconds(n)


def test_cluster_config_resolves_presets_and_overrides():
    cfg = build_config(TrainConfig, {}, ["cluster.preset=gbe10", "cluster.nodes=4"])
    c = cfg.cluster.resolve(16)
    assert (c.nodes, c.ranks_per_node, c.inter, c.backend) == (4, 4, PRESETS["gbe10"].inter, "gloo")
    cfg = build_config(TrainConfig, {"cluster": {"preset": "ib100", "inter_bytes_per_s": 5e9, "nodes": 3}})
    c = cfg.cluster.resolve(8)          # 8 workers on 3 nodes: 3 per node, the last node holds 2
    assert (c.ranks_per_node, c.inter.bytes_per_s, c.inter.latency_s) == (3, 5e9, PRESETS["ib100"].inter.latency_s)
    # no preset: the link between nodes is given, the one inside a node defaults to it
    cfg = build_config(TrainConfig, {"cluster": {"inter_latency_s": 1e-4, "inter_bytes_per_s": 1e8}})
    assert cfg.cluster.resolve(2).intra == Link(1e-4, 1e8)


@pytest.mark.parametrize("overrides,match", [
    (["cluster.preset=gbe5"], "cluster.preset='gbe5': one of gbe1, gbe10, ib100, nvlink"),
    (["cluster.preset=gbe1", "cluster.inter_bytes_per_s=-1"], "cluster.inter_bytes_per_s=-1"),
    (["cluster.preset=gbe1", "cluster.intra_latency_s=.nan"], "cluster.intra_latency_s"),
    (["cluster.nodes=0"], "cluster.nodes=0"),
    (["cluster.bandwidth=1e9"], "unknown config key 'cluster.bandwidth'"),
    (["cluster.nodes=2"], "cluster.inter_latency_s=None"),
    (["cluster.preset=gbe10", "cluster.allreduce=tree"], "cluster.allreduce='tree': needs cluster.backend='nccl'"),
    (["cluster.preset=gbe10", "cluster.backend=mpi"], "cluster.backend='mpi'"),
    (["cluster.preset=gbe10", "cluster.compute_step_s={16: 0.01}"], "needs cluster.compute_source"),
    (["cluster.preset=gbe10", "cluster.compute_step_s={16: -0.01}", "cluster.compute_source=x"], "step_s[16]"),
])
def test_bad_cluster_config_value_is_one_line(overrides, match):
    with pytest.raises(ConfigError) as e:
        build_config(TrainConfig, {}, overrides)
    assert match in str(e.value)
    assert "\n" not in str(e.value)


def test_too_few_ranks_for_the_workers_is_one_line():
    cfg = build_config(TrainConfig, {"cluster": {"preset": "gbe1", "nodes": 2, "ranks_per_node": 3}})
    with pytest.raises(ConfigError) as e:
        cfg.cluster.resolve(8)
    assert str(e.value) == ("invalid config value cluster.ranks_per_node=3: 2 nodes x 3 ranks hold fewer than "
                            "the run's 8 workers")


# ---------------------------------------------------------------------- compute and the run's account
def test_compute_profile_interpolates_between_measured_batches_only():
    p = ComputeProfile({16: 0.010, 64: 0.034}, source="given")
    assert p.seconds(16) == 0.010 and p.seconds(64) == 0.034
    # batch 32: 0.010 + (0.034 - 0.010) * 16 / 48 = 0.018
    assert p.seconds(32) == approx(0.018)
    with pytest.raises(ValueError, match="batch size 128 outside the profile's measured 16..64"):
        p.seconds(128)


def test_measure_profile_takes_the_median_after_the_warmup():
    import torch

    ticks = [0.0]
    calls = []

    def step(b):        # a real step of a small model; the clock below is advanced by the step itself
        calls.append(b)
        x = torch.ones(b, 8)
        (torch.nn.functional.linear(x, torch.ones(4, 8)).sum()).item()
        warm = calls.count(b) <= 2
        ticks[0] += 1.0 if warm else {1: 0.004, 2: 0.002, 3: 0.003}[calls.count(b) - 2] * b

    p = measure_profile(step, [1, 10], warmup=2, repeats=3, clock=lambda: ticks[0])
    # the warm-up calls (1 s each) are not timed; the median of 0.004 b, 0.002 b, 0.003 b is 0.003 b
    assert p.step_s == {1: approx(0.003), 10: approx(0.03)}
    assert calls == [1] * 5 + [10] * 5 and p.source == "measured on this machine"


def test_ledger_reports_wall_time_comm_share_and_bytes_per_link():
    c = Cluster(2, 1, inter=SLOW, intra=FAST)
    led = Ledger()
    cost = c.ring_allreduce([0, 1], 1e6)      # 2*1 ms + 2*1/2 * 1 MB / 1 MB/s = 1.002 s
    for r in (0, 1):
        led.compute(r, 3.0)
        led.comm(r, cost.seconds, cost if r == 0 else None)
    s = led.summary(4.002)
    # comm share: 2 * 1.002 / (2 * 3 + 2 * 1.002)
    assert s["comm_share"] == pytest.approx(2.004 / 8.004, abs=1e-6)
    assert s["bytes_per_link"] == {"node0->node1": 1000000, "node1->node0": 1000000}
    assert s["virtual_s"] == 4.002
