"""Property tests of the pure assignment schemes (pipeline.shards.schemes), over M, C, S, H, NB.

For every scheme: each sample is held by exactly C workers, worker sizes differ by at most one
row (so by at most one row group for any row-group size), the pairwise intersections match the
scheme's definition, groups of workers with equal data exist exactly where the scheme says,
seeds are distinct and the result is a pure function of (layout, N). Impossible layouts raise
ConfigError naming the parameter.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import ConfigError
from pipeline.shards import schemes
from pipeline.shards.permutation import permute
from pipeline.shards.schemes import (SCHEMES, Layout, Router, _bounds, assign, check_sample_count, expand_ranges,
                                     id_ranges, layout_from_manifest, resolve_layout)

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts(draw, scheme=None):
    """A valid layout of any scheme with 1 <= M <= 16, plus a sample count N >= its shard count."""
    scheme = scheme or draw(st.sampled_from(SCHEMES))
    M = draw(st.integers(1, 16))
    kw: dict = {}
    if scheme == "coarse":
        kw["shards"] = draw(st.sampled_from(divisors(M)))
    elif scheme in ("medium_coarse", "fine_grained"):
        kw["copies"] = draw(st.integers(1, M))
    elif scheme in ("households", "neighbourhoods"):
        H = draw(st.sampled_from(divisors(M)))
        kw["households"] = H
        if scheme == "neighbourhoods":
            kw["neighbourhoods"] = draw(st.sampled_from(divisors(H)))
        if draw(st.booleans()):
            kw["household_shards"] = draw(st.sampled_from(divisors(H)))
    layout = resolve_layout(scheme, M, seed=draw(st.integers(0, 2**31 - 1)), shuffle=draw(st.booleans()), **kw)
    n = draw(st.integers(max(layout.pieces, M), max(layout.pieces, M) + 300))
    return layout, n


def expected_equal_groups(layout: Layout) -> list[list[int]]:
    M, s = layout.workers, layout.scheme
    if s in ("full_overlap",) or (s in ("medium_coarse", "fine_grained") and layout.copies == M):
        return [list(range(M))] if M > 1 else []
    if s == "coarse":
        S = layout.shards
        return [list(range(k, M, S)) for k in range(S)] if M // S > 1 else []
    if s in ("households", "neighbourhoods"):
        W, SH, H = M // layout.households, layout.household_shards, layout.households
        if H // SH == 1:
            return []
        return sorted([[h * W + p for h in range(H) if h % SH == k] for k in range(SH) for p in range(W)])
    return []


def check_common(layout: Layout, n: int):
    a = assign(layout, n)
    M, C = layout.workers, layout.copies
    assert len(a.members) == M and len(a.seeds) == M and len(a.groups) == M
    # every sample exactly C times, no duplicates inside a worker
    assert np.array_equal(a.counts(), np.full(n, C))
    for m in a.members:
        assert np.unique(m).size == m.size and m.min() >= 0 and m.max() < n
    # balanced: sizes differ by at most one row (hence by at most one row group), sum = C*N
    sizes = a.sizes()
    assert sizes.max() - sizes.min() <= 1
    assert sizes.sum() == C * n
    # seeds: distinct; pure function of (layout, n)
    assert len(set(a.seeds)) == M
    b = assign(layout, n)
    assert all(np.array_equal(x, y) for x, y in zip(a.members, b.members)) and a.seeds == b.seeds
    # equal-data groups exactly where the scheme says
    assert a.equal_data_groups() == expected_equal_groups(layout)
    # the manifest's layout object rebuilds the same layout
    assert layout_from_manifest(layout.to_manifest()) == layout
    # the sizes the stage expects come from the router's table alone
    assert np.array_equal(Router.of(layout, n).sizes(), sizes)
    return a


@PROPS
@given(layouts())
def test_every_scheme_copies_balance_groups(ln):
    check_common(*ln)


@PROPS
@given(layouts("disjoint"))
def test_disjoint_partitions_the_samples(ln):
    layout, n = ln
    a = check_common(layout, n)
    inter = a.intersections()
    assert np.array_equal(inter, np.diag(a.sizes()))          # pairwise intersections all 0
    assert np.array_equal(np.sort(np.concatenate(a.members)), np.arange(n))


@PROPS
@given(layouts("full_overlap"))
def test_full_overlap_everyone_holds_everything(ln):
    layout, n = ln
    a = check_common(layout, n)
    assert layout.copies == layout.workers
    assert np.all(a.intersections() == n)


@PROPS
@given(layouts("coarse"))
def test_coarse_groups_of_m_over_s_hold_equal_shards(ln):
    layout, n = ln
    a = check_common(layout, n)
    M, S = layout.workers, layout.shards
    assert layout.copies == M // S
    inter, sizes = a.intersections(), a.sizes()
    for i, j in itertools.product(range(M), repeat=2):
        assert inter[i, j] == (sizes[i] if i % S == j % S else 0)


@PROPS
@given(layouts("medium_coarse"))
def test_medium_coarse_windows_of_c_shards(ln):
    layout, n = ln
    a = check_common(layout, n)
    M, C = layout.workers, layout.copies
    b = _bounds(n, M)
    shard_size = np.diff(b)
    inter = a.intersections()
    for i, j in itertools.product(range(M), repeat=2):
        common = {(i + k) % M for k in range(C)} & {(j + k) % M for k in range(C)}
        assert inter[i, j] == sum(shard_size[s] for s in common)
    # a worker shares data with exactly min(M, 2C-1) workers counting itself
    partners = (inter > 0).sum(axis=1)
    assert np.all(partners == min(M, 2 * C - 1))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts("fine_grained"))
def test_fine_grained_pairwise_intersections_nearly_equal(ln):
    layout, n = ln
    a = check_common(layout, n)
    M, C = layout.workers, layout.copies
    sizes = a.sizes()
    assert np.all(np.abs(sizes - C * n / M) < 1)               # each worker holds C*N/M samples
    if M < 2:
        return
    inter = a.intersections()
    off = inter[~np.eye(M, dtype=bool)]
    mean = n * C * (C - 1) / (M * (M - 1))                      # exact: every sample adds C(C-1) ordered pairs
    assert off.sum() == n * C * (C - 1)
    assert np.isclose(off.mean(), mean)
    assert off.var() <= 1.5, (off.var(), off.min(), off.max(), mean)
    assert np.all(np.abs(off - mean) <= 4)


@PROPS
@given(layouts("households"))
def test_households_split_household_shards(ln):
    layout, n = ln
    a = check_common(layout, n)
    M, H, SH = layout.workers, layout.households, layout.household_shards
    W = M // H
    assert layout.copies == H // SH
    inter, sizes = a.intersections(), a.sizes()
    for i, j in itertools.product(range(M), repeat=2):
        hi, hj, pi, pj = i // W, j // W, i % W, j % W
        same_piece = hi % SH == hj % SH and pi == pj
        assert inter[i, j] == (sizes[i] if same_piece else 0)
    # a household's workers are disjoint and together hold its household shard
    for h in range(H):
        hh = [a.members[h * W + p] for p in range(W)]
        assert sum(len(x) for x in hh) == np.unique(np.concatenate(hh)).size
    assert [g["household"] for g in a.groups] == [i // W for i in range(M)]
    # households with equal data still get different shuffle seeds (all seeds are distinct)
    assert len(set(a.seeds)) == M


@PROPS
@given(layouts("neighbourhoods"))
def test_neighbourhoods(ln):
    layout, n = ln
    a = check_common(layout, n)
    M, H, NB, SH = layout.workers, layout.households, layout.neighbourhoods, layout.household_shards
    W, per_nb = M // H, H // NB
    assert [g["neighbourhood"] for g in a.groups] == [(i // W) // per_nb for i in range(M)]
    if SH == H // NB:  # full overlap between neighbourhoods: disjoint inside, whole dataset in each
        for k in range(NB):
            held = np.concatenate([a.members[i] for i in range(M) if a.groups[i]["neighbourhood"] == k])
            assert np.array_equal(np.sort(held), np.arange(n))
        assert layout.copies == NB


def test_neighbourhoods_default_is_full_overlap_between_neighbourhoods():
    lay = resolve_layout("neighbourhoods", 8, households=4, neighbourhoods=2)
    assert lay.household_shards == 2 and lay.copies == 2
    assert resolve_layout("households", 8, households=4).household_shards == 4       # disjoint households
    assert resolve_layout("households", 8, households=4).copies == 1


def test_shuffle_false_gives_contiguous_ranges():
    a = assign(resolve_layout("disjoint", 4, shuffle=False), 10)
    assert [id_ranges(m) for m in a.members] == [[[0, 1]], [[2, 4]], [[5, 6]], [[7, 9]]]


def test_seed_changes_the_assignment():
    a = assign(resolve_layout("disjoint", 4, seed=1), 100)
    b = assign(resolve_layout("disjoint", 4, seed=2), 100)
    assert not all(np.array_equal(np.sort(x), np.sort(y)) for x, y in zip(a.members, b.members))


@PROPS
@given(st.lists(st.integers(-50, 50), unique=True, max_size=60))
def test_id_ranges_round_trip(ids):
    r = id_ranges(np.array(ids, dtype=np.int64))
    assert np.array_equal(expand_ranges(r), np.sort(np.array(ids, dtype=np.int64)))
    assert all(a <= b for a, b in r) and all(r[k][1] + 1 < r[k + 1][0] for k in range(len(r) - 1))


# --------------------------------------------------------------------------- impossible layouts
@pytest.mark.parametrize("args, kwargs, param", [
    (("medium_coarse", 4), dict(copies=5), "copies"),
    (("fine_grained", 4), dict(copies=5), "copies"),
    (("fine_grained", 4), dict(copies=0), "copies"),
    (("fine_grained", 4), {}, "copies"),
    (("coarse", 6), dict(shards=4), "shards"),
    (("coarse", 4), dict(shards=8), "shards"),
    (("coarse", 4), {}, "shards"),
    (("coarse", 4), dict(shards=2, copies=3), "copies"),
    (("disjoint", 4), dict(copies=2), "copies"),
    (("full_overlap", 4), dict(copies=2), "copies"),
    (("households", 6), dict(households=4), "households"),
    (("households", 4), dict(households=8), "households"),
    (("households", 8), dict(households=4, household_shards=3), "household_shards"),
    (("households", 8), dict(households=4, household_shards=2, copies=1), "copies"),
    (("neighbourhoods", 8), dict(households=4, neighbourhoods=3), "neighbourhoods"),
    (("neighbourhoods", 8), dict(households=4), "neighbourhoods"),
    (("disjoint", 4), dict(shards=4), "shards"),
    (("disjoint", 0), {}, "workers"),
    (("round_robin", 4), {}, "scheme"),
])
def test_impossible_layouts_name_the_parameter(args, kwargs, param):
    with pytest.raises(ConfigError) as e:
        resolve_layout(*args, **kwargs)
    assert f"{param}=" in str(e.value) or param in str(e.value).split()[0]
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout, n, param", [
    (resolve_layout("disjoint", 8), 5, "workers=8"),
    (resolve_layout("fine_grained", 8, copies=2), 7, "workers=8"),
    (resolve_layout("coarse", 8, shards=4), 3, "shards=4"),
    (resolve_layout("households", 8, households=4, household_shards=2), 3, "household_shards=2"),
    (resolve_layout("full_overlap", 3), 0, "empty"),
])
def test_more_shards_than_samples_is_rejected(layout, n, param):
    with pytest.raises(ConfigError, match=param):
        check_sample_count(layout, n)
    with pytest.raises(ConfigError, match=param):
        assign(layout, n)


@settings(max_examples=150, deadline=None)
@given(scheme=st.sampled_from(SCHEMES), M=st.integers(0, 12), C=st.none() | st.integers(0, 14),
       S=st.none() | st.integers(1, 14), H=st.none() | st.integers(1, 14), NB=st.none() | st.integers(1, 14),
       SH=st.none() | st.integers(1, 14), n=st.integers(0, 40))
def test_any_parameters_either_work_or_name_a_parameter(scheme, M, C, S, H, NB, SH, n):
    """Arbitrary parameter combinations: a valid layout satisfies the invariants; an invalid one
    raises ConfigError naming one of the parameters."""
    names = ("workers", "copies", "shards", "households", "household_shards", "neighbourhoods", "scheme")
    try:
        layout = resolve_layout(scheme, M, C, shards=S, households=H, household_shards=SH, neighbourhoods=NB)
        a = assign(layout, n)
    except ConfigError as e:
        msg = str(e)
        assert any(p in msg for p in names) or "training split" in msg, msg
        return
    assert np.array_equal(a.counts(), np.full(n, layout.copies))
    assert a.sizes().max() - a.sizes().min() <= 1
    if C is not None:
        assert layout.copies == C


@PROPS
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1))
def test_the_keyed_permutation_is_a_bijection_computed_per_element(n, seed):
    x = np.arange(n)
    y = permute(x, n, seed)
    assert np.array_equal(np.sort(y), x)
    part = np.random.default_rng(seed).choice(n, size=min(n, 17), replace=False)
    assert np.array_equal(permute(part, n, seed), y[part])          # any element alone, anywhere
    if n > 20:
        assert not np.array_equal(permute(x, n, seed + 1), y)       # the key matters
        assert not np.array_equal(y, x)


def test_fine_grained_beyond_its_period_repeats_a_balanced_design(monkeypatch):
    """N larger than the design's period: the design repeats; every sample still has C workers,
    the loads differ by at most one and the pairwise intersections stay near their mean."""
    monkeypatch.setattr(schemes, "FINE_GRAINED_PERIOD", 500)
    layout = resolve_layout("fine_grained", 8, 3, seed=4)
    n = 5003
    a = check_common(layout, n)
    assert Router.of(layout, n).period == 504
    M, C = 8, 3
    off = a.intersections()[~np.eye(M, dtype=bool)]
    mean = n * C * (C - 1) / (M * (M - 1))
    assert off.sum() == n * C * (C - 1) and np.all(np.abs(off - mean) <= 0.05 * mean), (off, mean)
