"""Communication graphs, random matchings, mixing matrices and exchange schedules (pure functions)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pipeline.errors import ConfigError
from pipeline.train.topology import _round_robin, check_partners, make_graph

GRAPHS = [("complete", n, None) for n in (1, 2, 3, 4, 5, 8)] + \
         [("ring", n, None) for n in (2, 3, 4, 5, 7, 8)] + \
         [("regular", 8, 3), ("regular", 8, 4), ("regular", 9, 4), ("regular", 6, 5), ("regular", 6, 1)]


@pytest.mark.parametrize("kind,n,deg", GRAPHS)
def test_matching_is_valid_on_graph_and_near_perfect(kind, n, deg):
    g = make_graph(kind, n, deg)
    for r in range(200):
        p = g.matching(seed=7, round_index=r)
        check_partners(p)  # never self, never two partners (symmetric)
        assert len(p) == n
        paired = [i for i in range(n) if p[i] is not None]
        for i in paired:
            assert p[i] != i
            assert g.has_edge(i, p[i]), f"{kind}: pair {i}-{p[i]} is not an edge"
        # a perfect matching for even n, exactly one worker sitting out for odd n
        assert n - len(paired) == n % 2


def test_check_partners_rejects_bad_matchings():
    with pytest.raises(ValueError, match="itself"):
        check_partners([0, None])
    with pytest.raises(ValueError, match="->"):
        check_partners([1, 2, 0])  # 0->1 but 1->2: a worker with two partners
    with pytest.raises(ValueError, match="nonexistent"):
        check_partners([5, None])


def test_matching_sequence_reproducible_and_seed_dependent():
    g = make_graph("complete", 6)
    a = [g.matching(3, r) for r in range(50)]
    b = [make_graph("complete", 6).matching(3, r) for r in range(50)]
    c = [g.matching(4, r) for r in range(50)]
    assert a == b
    assert a != c
    # rounds differ from each other (the matching is redrawn every round)
    assert len({tuple(m) for m in a}) > 10


def test_matching_identical_in_separate_processes():
    """Every worker is a different process: the sequence must not depend on process state."""
    code = ("import json,sys; from pipeline.train.topology import make_graph;"
            "g=make_graph(sys.argv[1], int(sys.argv[2])); print(json.dumps([g.matching(11, r) for r in range(30)]))")
    outs = [subprocess.run([sys.executable, "-c", code, kind, "5"], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(h), "PATH": ""}).stdout
            for kind in ("ring",) for h in (1, 2)]
    assert outs[0] == outs[1]
    g = make_graph("ring", 5)
    import json
    assert json.loads(outs[0]) == [g.matching(11, r) for r in range(30)]


def test_complete_matching_is_uniform_over_pairs():
    g = make_graph("complete", 4)
    counts = np.zeros((4, 4))
    rounds = 3000
    for r in range(rounds):
        p = g.matching(0, r)
        for i, j in enumerate(p):
            counts[i, j] += 1
    off = counts[~np.eye(4, dtype=bool)] / rounds
    assert np.allclose(off, 1 / 3, atol=0.04), off  # each of the 3 possible partners ~1/3 of the rounds


def test_odd_count_sitter_rotates():
    g = make_graph("complete", 5)
    out = [g.matching(1, r).index(None) for r in range(500)]
    assert set(out) == set(range(5))


@pytest.mark.parametrize("kind,n,deg", [g for g in GRAPHS if g[1] > 0])
def test_mixing_matrix_doubly_stochastic_on_graph(kind, n, deg):
    g = make_graph(kind, n, deg)
    w = g.mixing_matrix()
    assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1)
    assert np.allclose(w, w.T)
    assert (w >= 0).all()
    for i in range(n):
        for j in range(n):
            if i != j and not g.has_edge(i, j):
                assert w[i, j] == 0


def test_mixing_matrix_known_values():
    assert np.allclose(make_graph("complete", 4).mixing_matrix(), 0.25)
    w = make_graph("ring", 6).mixing_matrix()
    assert np.allclose(np.diag(w), 1 / 3) and np.isclose(w[0, 1], 1 / 3) and np.isclose(w[0, 5], 1 / 3)
    assert np.allclose(make_graph("ring", 2).mixing_matrix(), 0.5)


@pytest.mark.parametrize("kind,n,deg", [g for g in GRAPHS if g[1] > 1])
def test_exchange_rounds_cover_every_edge_once(kind, n, deg):
    g = make_graph(kind, n, deg)
    rounds = g.exchange_rounds()
    seen = []
    for p in rounds:
        check_partners(p)
        seen += [(i, j) for i, j in enumerate(p) if j is not None and i < j]
    assert sorted(seen) == sorted(g.edges)
    if kind == "complete":
        assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    if kind == "ring" and n >= 3:
        assert len(rounds) == (2 if n % 2 == 0 else 3)


def test_round_robin_pairs_everyone():
    for n in range(2, 10):
        pairs = {(i, j) for p in _round_robin(n) for i, j in enumerate(p) if j is not None and i < j}
        assert len(pairs) == n * (n - 1) // 2


def test_regular_graph_degrees_and_errors():
    g = make_graph("regular", 10, 4)
    assert all(g.degree(i) == 4 for i in range(10))
    assert make_graph("regular", 6, 5).edges == make_graph("complete", 6).edges
    assert make_graph("regular", 7, 2).edges == make_graph("ring", 7).edges
    with pytest.raises(ConfigError, match="odd degree"):
        make_graph("regular", 7, 3)
    with pytest.raises(ConfigError, match="topology_degree=8"):
        make_graph("regular", 8, 8)
    with pytest.raises(ConfigError, match="needs a degree"):
        make_graph("regular", 8)
    with pytest.raises(ConfigError, match="unknown topology 'star'"):
        make_graph("star", 4)
