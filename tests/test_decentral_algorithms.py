"""SwarmSGD, D-PSGD, EASGD and consensus distance on real worker processes, both backends.

One process group per backend runs every check (:func:`decentral_fixtures.algorithm_checks`)
to keep the start-up cost down; the assertions run here, on the gathered results.
"""
from __future__ import annotations

import numpy as np
import pytest

from decentral_fixtures import _flat, _net, algorithm_checks, run_horovod_workers, run_torch_workers
from pipeline.train.consensus import consensus_distance_of
from pipeline.train.topology import check_partners, make_graph

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def torch4():
    return run_torch_workers(algorithm_checks, 4, "complete", 12, 5, True)


@pytest.fixture(scope="module")
def torch3_ring():
    return run_torch_workers(algorithm_checks, 3, "ring")


@pytest.fixture(scope="module")
def horovod4_ring():
    return run_horovod_workers(algorithm_checks, 4, "ring")


RUNS = ["torch4", "torch3_ring", pytest.param("horovod4_ring", marks=pytest.mark.needs_horovod)]


def _check_swarm(res, topology):
    world = len(res)
    g = make_graph(topology, world)
    rounds = len(res[0]["swarm"]["partners"])
    assert rounds >= 2, rounds
    for r in range(rounds):
        # every worker computed the same matching, and it is the seeded one
        assert all(x["swarm"]["matchings"][r] == g.matching(5, r) for x in res)
        partners = [x["swarm"]["partners"][r] for x in res]
        assert partners == g.matching(5, r)
        check_partners(partners)
        pre = np.stack([x["swarm"]["pre"][r] for x in res])
        post = np.stack([x["swarm"]["post"][r] for x in res])
        assert not np.allclose(pre, pre[0])  # the models really differ
        # the global mean of the parameters is preserved exactly (float tolerance)
        np.testing.assert_allclose(post.mean(0), pre.mean(0), rtol=0, atol=1e-6)
        for i, p in enumerate(partners):
            if p is None:
                np.testing.assert_array_equal(post[i], pre[i])
            else:
                np.testing.assert_allclose(post[i], (pre[i] + pre[p]) / 2, rtol=0, atol=1e-6)
                np.testing.assert_array_equal(post[i], post[p])
    if world % 2:
        sat = [r for r in range(rounds) for x in res if x["swarm"]["partners"][r] is None]
        assert len(sat) == rounds  # exactly one worker sits out each round


@pytest.mark.parametrize("run", RUNS)
def test_swarm_pairwise_averaging_preserves_mean(run, request):
    res = request.getfixturevalue(run)
    topology = "complete" if run == "torch4" else "ring"
    _check_swarm(res, topology)


@pytest.mark.parametrize("run", RUNS)
def test_dpsgd_mixing_applies_w(run, request):
    res = request.getfixturevalue(run)
    W = res[0]["mix"]["W"]
    pre = np.stack([x["mix"]["pre"] for x in res])
    post = np.stack([x["mix"]["post"] for x in res])
    np.testing.assert_allclose(post, W @ pre, rtol=0, atol=1e-6)
    np.testing.assert_allclose(post.mean(0), pre.mean(0), rtol=0, atol=1e-6)  # W doubly stochastic


@pytest.mark.parametrize("run", RUNS)
def test_dpsgd_complete_graph_equals_allreduce_parameter_averaging(run, request):
    res = request.getfixturevalue(run)
    for x in res:
        assert x["dpsgd_vs_allreduce"] < 1e-6
    spread = np.stack([x["dpsgd_spread"] for x in res])
    assert consensus_distance_of(spread) > 0  # each rank applied its own gradient


@pytest.mark.parametrize("run", RUNS)
def test_dpsgd_atc_uniform_equals_arsgd(run, request):
    res = request.getfixturevalue(run)
    for x in res:
        assert x["atc_vs_arsgd"] < 1e-6
    finals = np.stack([x["atc_final"] for x in res])
    np.testing.assert_allclose(finals, np.broadcast_to(finals[0], finals.shape), atol=1e-7)


@pytest.mark.parametrize("run", RUNS)
def test_easgd_elastic_step(run, request):
    res = request.getfixturevalue(run)
    world = len(res)
    alpha = 0.2
    assert len(res[0]["easgd"]) == 6 and sum(rec[4] for rec in res[0]["easgd"]) == 3   # 6 steps, 3 elastic
    for s in range(len(res[0]["easgd"])):
        xb = np.stack([x["easgd"][s][0] for x in res])
        cb = res[0]["easgd"][s][1]
        xa = np.stack([x["easgd"][s][2] for x in res])
        ca = res[0]["easgd"][s][3]
        assert all(x["easgd"][s][4] == ((s + 1) % 2 == 0) for x in res)  # elastic step every tau = 2 steps
        for x in res:  # every worker holds the same centre
            np.testing.assert_allclose(x["easgd"][s][3], ca, atol=1e-7)
        if (s + 1) % 2 == 0:
            np.testing.assert_allclose(xa, xb - alpha * (xb - cb), atol=1e-6)
            np.testing.assert_allclose(ca, cb + world * alpha * (xb.mean(0) - cb), atol=1e-6)
            np.testing.assert_allclose(xa.sum(0) + ca, xb.sum(0) + cb, atol=1e-5)
            assert not np.allclose(ca, cb)
    # the centre starts at the world average of the initial models (computed here from their seeds)
    init = np.stack([_flat(_net(500 + r)) for r in range(world)])
    np.testing.assert_allclose(res[0]["easgd"][0][3], init.mean(0), atol=1e-6)
    assert not np.allclose(init[0], init.mean(0))


@pytest.mark.parametrize("run", RUNS)
def test_swarm_uses_the_run_seed(run, request):
    res = request.getfixturevalue(run)
    topology = "complete" if run == "torch4" else "ring"
    g = make_graph(topology, len(res))
    for tag, seed in (("a", 1), ("b", 2), ("a2", 1)):
        got = [[x["seeded_partners"][tag][r] for x in res] for r in range(8)]
        assert got == [g.matching(seed, r) for r in range(8)], tag
    seq = {tag: [x["seeded_partners"][tag] for x in res] for tag in ("a", "b", "a2")}
    assert seq["a"] == seq["a2"] and seq["a"] != seq["b"]


@pytest.mark.parametrize("run", RUNS)
def test_slowmo_x0_is_the_broadcast_start(run, request):
    res = request.getfixturevalue(run)
    init = np.stack([x["slowmo_x0"]["init"] for x in res])
    np.testing.assert_array_equal(init, np.broadcast_to(init[0], init.shape))  # rank 0's weights everywhere
    assert not np.allclose(init[0], _flat(_net(1100 + 1)))  # and the ranks really started apart
    pre = np.stack([x["slowmo_x0"]["pre"] for x in res])
    # alpha = 0.5, beta = 0.5, first outer step (u = 0): x = x0 - 0.5 * (x0 - mean(x_pre))
    want = init[0] - 0.5 * (init[0] - pre.mean(0))
    for x in res:
        np.testing.assert_allclose(x["slowmo_x0"]["post"], want, atol=1e-6)


@pytest.mark.parametrize("run", RUNS)
def test_consensus_distance_collective_matches_formula(run, request):
    res = request.getfixturevalue(run)
    xs = [x["consensus"]["x"] for x in res]
    want = consensus_distance_of(xs)
    assert want > 0
    for x in res:
        assert x["consensus"]["d"] == pytest.approx(want, rel=1e-6)


def test_torch_exchange_involves_only_partners(torch3_ring):
    """Point to point: with 3 workers one sits out each round and makes no exchange call."""
    calls = [x["exchange_calls"] for x in torch3_ring]
    sat = [sum(p is None for p in x["swarm"]["partners"]) for x in torch3_ring]
    assert sum(sat) == len(torch3_ring[0]["swarm"]["partners"])
    # every rank did the same all-reduces; the ranks that sat out more made fewer calls
    order = np.argsort(sat)
    assert calls[order[0]] - calls[order[-1]] == sat[order[-1]] - sat[order[0]]


# ----------------------------------------------------------------------------- time-budgeted rounds
def test_time_budget_slow_worker_takes_fewer_steps_and_rounds_stay_aligned(torch4):
    t = [x["time"] for x in torch4]
    rounds = [len(x["swarm_log"]) for x in t]
    assert len(set(rounds)) == 1  # every worker completed the same rounds
    per_round = np.array([[rec[1] for rec in x["swarm_log"]] for x in t])  # [rank, round] local steps
    assert per_round.shape == (4, 6) and (per_round >= 1).all(), per_round
    slow, fast = per_round[0].mean(), per_round[1:].mean()
    assert slow < fast, per_round  # worker 0 (3x slower) takes fewer steps per round instead of waiting


def test_time_budget_swarm_step_weighted_average(torch4):
    t = [x["time"] for x in torch4]
    assert len(t[0]["swarm_log"]) >= 6 and all(len(x["swarm_log"]) == len(t[0]["swarm_log"]) for x in t)
    paired = 0
    for r in range(len(t[0]["swarm_log"])):
        recs = [x["swarm_log"][r] for x in t]
        partners = [rec[4] for rec in recs]
        check_partners(partners)
        for i, (_, h, before, after, p) in enumerate(recs):
            if p is None:
                np.testing.assert_array_equal(after, before)
                continue
            _, hp, bp, ap, _ = recs[p]
            np.testing.assert_allclose(after, (h * before + hp * bp) / (h + hp), atol=1e-6)
            np.testing.assert_array_equal(after, ap)
            paired += 1
    assert paired > 0


def test_time_budget_local_sgd_step_weighted_average(torch4):
    t = [x["time"] for x in torch4]
    assert len(t[0]["local_log"]) >= 6 and all(len(x["local_log"]) == len(t[0]["local_log"]) for x in t)
    for r in range(len(t[0]["local_log"])):
        recs = [x["local_log"][r] for x in t]
        h = np.array([rec[1] for rec in recs], dtype=np.float64)
        before = np.stack([rec[2] for rec in recs])
        want = (h[:, None] * before).sum(0) / h.sum()
        for rec in recs:
            np.testing.assert_allclose(rec[3], want, atol=1e-5)


def test_slowmo_around_time_budget_counts_rounds(torch4):
    t = [x["time"] for x in torch4]
    assert {x["slowmo"]["type"] for x in t} == {"RoundSlowMo"}
    n = len(t[0]["slowmo"]["snaps"])
    assert n >= 6 and all(len(x["slowmo"]["snaps"]) == n for x in t)
    assert {t[0]["slowmo"]["snaps"][k][0] % 2 for k in range(n)} == {0, 1}   # outer steps and rounds between
    for k in range(n):
        r = t[0]["slowmo"]["snaps"][k][0]
        xs = np.stack([x["slowmo"]["snaps"][k][1] for x in t])
        if r % 2 == 0:  # outer step (tau = 2 rounds): exact average, then identical slow-momentum step
            np.testing.assert_allclose(xs, np.broadcast_to(xs[0], xs.shape), atol=1e-6)
        else:  # in between, SwarmSGD pairs only: the workers differ
            assert consensus_distance_of(xs) > 0
