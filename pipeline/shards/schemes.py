"""Data assignment schemes for data-parallel training (pure, seeded, no Spark).

Follows Håland & Birkeland, "Exploring data assignment schemes when training deep neural
networks using data parallelism" (NTNU 2020). ``M`` workers share ``N`` training samples;
every sample is held by ``C`` workers (its *copies*, 1 <= C <= M).

Schemes (``Layout.scheme``):

``disjoint``        S = M shards, worker i holds shard i (C = 1).
``full_overlap``    every worker holds every sample (C = M).
``coarse``          S shards (S divides M, normally 1 < S < M), worker i holds shard i mod S; the
                    M/S workers i, i+S, i+2S, ... hold equal data (C = M/S).
``medium_coarse``   M shards, worker i holds shards i, i+1, ..., i+C-1 (mod M): a worker shares
                    data with the 2C-2 workers nearest to it (all others when 2C-1 > M) and no two
                    workers hold equal data unless C = M.
``fine_grained``    every sample goes to exactly C workers, chosen greedily (least-loaded workers
                    first, then the ones sharing the fewest samples with those already chosen,
                    seeded tie-breaks) so each worker holds C*N/M samples (+-1) and the pairwise
                    intersections are all about N*C*(C-1)/(M*(M-1)) (variance close to 0); for
                    small N a repair pass swaps memberships so no two workers hold equal data
                    (unless C = M).
``households``      H households of W = M/H consecutive workers (worker i is in household i // W).
                    S_H household shards (S_H divides H; default H = disjoint); household h holds
                    household shard h mod S_H, split disjointly among its W workers. Workers at
                    the same position of households with equal data hold equal data
                    (C = H/S_H); every household has its own seed so they do not see the same
                    batches.
``neighbourhoods``  households grouped into NB neighbourhoods of H/NB consecutive households. The
                    default S_H = H/NB is "full overlap between neighbourhoods": no overlap inside
                    a neighbourhood, every neighbourhood holds the whole dataset (C = NB). Other
                    S_H dividing H follow the household rule above.

How samples are cut: the N training samples (by position 0..N-1 in sorted-``sample_id`` order)
are permuted with the layout seed (``shuffle=True``, the default, so shards are label-balanced
even when ids are ordered by label) and cut into P equal pieces (piece j = positions
[floor(jN/P), floor((j+1)N/P)) of the permutation), so every worker's sample count differs from
every other's by at most one row (a window of C consecutive pieces also differs by at most one).
Each worker's list is finally shuffled with the worker's own seed: that is the row order written
to its Parquet directory, so equal-data workers also hold their rows in different orders.

Impossible layouts (C > M, S not dividing M, more shards than samples, H not dividing M, ...)
raise :class:`~pipeline.errors.ConfigError` naming the parameter.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..errors import ConfigError

SCHEMES = ("disjoint", "full_overlap", "coarse", "medium_coarse", "fine_grained", "households",
           "neighbourhoods")


@dataclass(frozen=True)
class Layout:
    """A fully resolved layout: every parameter the scheme uses is set and consistent."""

    scheme: str
    workers: int
    copies: int
    seed: int = 0
    shards: Optional[int] = None            # S (disjoint: M, coarse: S, medium_coarse: M)
    households: Optional[int] = None        # H
    household_shards: Optional[int] = None  # S_H
    neighbourhoods: Optional[int] = None    # NB
    shuffle: bool = True

    @property
    def pieces(self) -> int:
        """How many equal pieces the training split is cut into (must not exceed N)."""
        if self.scheme == "full_overlap":
            return 1
        if self.scheme in ("households", "neighbourhoods"):
            return self.household_shards * (self.workers // self.households)
        if self.scheme == "fine_grained":
            return self.workers
        return self.shards

    def to_manifest(self) -> dict:
        """The manifest's ``layout`` object: scheme, workers, copies, scheme params, seed."""
        d: dict = {"scheme": self.scheme, "workers": self.workers, "copies": self.copies}
        for k in ("shards", "households", "household_shards", "neighbourhoods"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        d["shuffle"] = self.shuffle
        d["seed"] = self.seed
        return d


def _need(name: str, value: Optional[int], scheme: str) -> int:
    if value is None:
        raise ConfigError(f"{name} must be set for scheme {scheme!r}")
    if value < 1:
        raise ConfigError(f"{name}={value} must be >= 1")
    return value


def _copies_match(copies: Optional[int], derived: int, why: str) -> None:
    if copies is not None and copies != derived:
        raise ConfigError(f"copies={copies} is impossible for this layout: {why} gives copies={derived}")


def _check_divides(name: str, value: int, of_name: str, of_value: int,
                   larger_why: str = "", divide_why: str = "") -> None:
    """ConfigError naming ``name`` unless ``value`` <= ``of_value`` and divides it."""
    if value > of_value:
        raise ConfigError(f"{name}={value} is larger than {of_name}={of_value}{larger_why}")
    if of_value % value:
        raise ConfigError(f"{name}={value} does not divide {of_name}={of_value}{divide_why}")


def resolve_layout(scheme: str, workers: int, copies: Optional[int] = None, *, shards: Optional[int] = None,
                   households: Optional[int] = None, household_shards: Optional[int] = None,
                   neighbourhoods: Optional[int] = None, seed: int = 0, shuffle: bool = True) -> Layout:
    """Check a layout and fill in what the scheme implies (copies, S, S_H).

    Raises ConfigError naming the parameter when the layout is impossible. Parameters a
    scheme does not use must be left unset (None), so a typo cannot be silently ignored.
    """
    if scheme not in SCHEMES:
        raise ConfigError(f"scheme={scheme!r} is unknown (choose one of {', '.join(SCHEMES)})")
    if workers is None or workers < 1:
        raise ConfigError(f"workers={workers} must be >= 1")
    M = workers
    if copies is not None and copies < 1:
        raise ConfigError(f"copies={copies} must be >= 1")
    if copies is not None and copies > M:
        raise ConfigError(f"copies={copies} is larger than workers={M}")
    if seed is None or seed < 0:
        raise ConfigError(f"seed={seed} must be >= 0")
    used = {"disjoint": set(), "full_overlap": set(), "coarse": {"shards"}, "medium_coarse": set(),
            "fine_grained": set(), "households": {"households", "household_shards"},
            "neighbourhoods": {"households", "household_shards", "neighbourhoods"}}[scheme]
    given = {"shards": shards, "households": households, "household_shards": household_shards,
             "neighbourhoods": neighbourhoods}
    for k, v in given.items():
        if v is not None and k not in used:
            raise ConfigError(f"{k}={v} is not a parameter of scheme {scheme!r}")
    common = dict(scheme=scheme, workers=M, seed=int(seed), shuffle=bool(shuffle))

    if scheme == "disjoint":
        _copies_match(copies, 1, "disjoint shards")
        return Layout(copies=1, shards=M, **common)
    if scheme == "full_overlap":
        _copies_match(copies, M, f"full overlap over workers={M}")
        return Layout(copies=M, **common)
    if scheme == "coarse":
        S = _need("shards", shards, scheme)
        _check_divides("shards", S, "workers", M, " (coarse sharding needs S <= M)",
                       " (coarse sharding needs M/S equal groups)")
        _copies_match(copies, M // S, f"workers={M} over shards={S}")
        return Layout(copies=M // S, shards=S, **common)
    if scheme in ("medium_coarse", "fine_grained"):
        C = _need("copies", copies, scheme)
        return Layout(copies=C, shards=M if scheme == "medium_coarse" else None, **common)

    H = _need("households", households, scheme)
    _check_divides("households", H, "workers", M)
    NB = None
    if scheme == "neighbourhoods":
        NB = _need("neighbourhoods", neighbourhoods, scheme)
        _check_divides("neighbourhoods", NB, "households", H)
        default_sh = H // NB          # full overlap between neighbourhoods
    else:
        default_sh = H                # disjoint households
    SH = household_shards if household_shards is not None else default_sh
    if SH < 1:
        raise ConfigError(f"household_shards={SH} must be >= 1")
    if SH > H:
        raise ConfigError(f"household_shards={SH} is larger than households={H}")
    if H % SH:
        raise ConfigError(f"household_shards={SH} does not divide households={H}")
    _copies_match(copies, H // SH, f"households={H} over household_shards={SH}")
    return Layout(copies=H // SH, households=H, household_shards=SH, neighbourhoods=NB, **common)


def layout_from_manifest(d: dict) -> Layout:
    """Rebuild (and re-check) a Layout from a manifest's ``layout`` object."""
    return resolve_layout(d["scheme"], d["workers"], d.get("copies"), shards=d.get("shards") if d["scheme"] == "coarse" else None,
                          households=d.get("households"), household_shards=d.get("household_shards"),
                          neighbourhoods=d.get("neighbourhoods"), seed=d.get("seed", 0),
                          shuffle=d.get("shuffle", True))


def check_sample_count(layout: Layout, n: int) -> None:
    """ConfigError when the training split is too small for the layout (more shards than samples)."""
    if n < 1:
        raise ConfigError("the training split is empty: nothing to assign")
    p = max(layout.pieces, layout.workers if layout.scheme == "fine_grained" else 1)
    if p > n:
        param = {"coarse": f"shards={layout.shards}",
                 "households": f"household_shards={layout.household_shards} x workers/households",
                 "neighbourhoods": f"household_shards={layout.household_shards} x workers/households",
                 }.get(layout.scheme, f"workers={layout.workers}")
        raise ConfigError(f"{param} needs {p} shards but the training split has only {n} samples")


@dataclass
class Assignment:
    """Which samples each worker holds, plus its shuffle seed and group labels.

    ``members[i]`` holds sample *positions* 0..N-1 (index into the sorted training
    ``sample_id`` array) in worker i's write order.
    """

    layout: Layout
    n: int
    members: list[np.ndarray]
    seeds: list[int]
    groups: list[dict] = field(default_factory=list)

    def counts(self) -> np.ndarray:
        """How many workers hold each sample (length N)."""
        return np.bincount(np.concatenate(self.members), minlength=self.n)

    def sizes(self) -> np.ndarray:
        return np.array([len(m) for m in self.members])

    def incidence(self) -> np.ndarray:
        """Boolean M x N matrix: worker i holds sample j."""
        inc = np.zeros((self.layout.workers, self.n), dtype=bool)
        for i, m in enumerate(self.members):
            inc[i, m] = True
        return inc

    def intersections(self) -> np.ndarray:
        """M x M matrix of shared sample counts (diagonal: worker sizes)."""
        inc = self.incidence().astype(np.int64)
        return inc @ inc.T

    def equal_data_groups(self) -> list[list[int]]:
        """Groups (size >= 2) of workers holding exactly the same samples, sorted."""
        by_set: dict[bytes, list[int]] = {}
        for i, m in enumerate(self.members):
            by_set.setdefault(np.sort(m).tobytes(), []).append(i)
        return sorted(g for g in by_set.values() if len(g) > 1)


def _seed_of(*key: int) -> int:
    """A 31-bit seed derived from the key (numpy SeedSequence: well mixed, reproducible)."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, dtype=np.uint32)[0] & 0x7FFFFFFF)


def worker_seeds(layout: Layout) -> list[int]:
    """Per-worker shuffle seeds, all distinct. Household schemes derive them from per-household
    seeds (household seed = f(seed, h), worker seed = f(household seed, position))."""
    M = layout.workers
    if layout.households:
        W = M // layout.households
        seeds = [_seed_of(_seed_of(layout.seed, 1, i // W), i % W) for i in range(M)]
    else:
        seeds = [_seed_of(layout.seed, 0, i) for i in range(M)]
    seen: set[int] = set()
    for i, s in enumerate(seeds):  # astronomically rare collisions: make them distinct anyway
        while s in seen:
            s = (s + 1) & 0x7FFFFFFF
        seen.add(s)
        seeds[i] = s
    return seeds


def worker_groups(layout: Layout) -> list[dict]:
    """Manifest ``group`` per worker: household and neighbourhood for household schemes, else {}."""
    M = layout.workers
    if not layout.households:
        return [{} for _ in range(M)]
    W = M // layout.households
    hpn = layout.households // (layout.neighbourhoods or 1)
    return [{"household": i // W, "neighbourhood": (i // W) // hpn} for i in range(M)]


def _bounds(n: int, p: int) -> np.ndarray:
    """Cut points of n items into p pieces whose sizes differ by at most one."""
    return (np.arange(p + 1, dtype=np.int64) * n) // p


def _fine_grained(n: int, M: int, C: int, seed: int) -> list[list[int]]:
    """Greedy balanced design: for each sample the C least-loaded workers, ties broken by the
    fewest samples already shared with the workers chosen so far, then randomly (seeded).
    Loads stay within one of each other; pairwise intersections stay within a few samples of
    the mean N*C*(C-1)/(M*(M-1)). O(N*C*M) in pure Python (~1 s for N=16k, M=16, C=8)."""
    rnd = random.Random(seed)
    load = [0] * M
    pair = [[0] * M for _ in range(M)]
    per_worker: list[list[int]] = [[] for _ in range(M)]
    order = list(range(M))
    for s in range(n):
        rnd.shuffle(order)                    # random tie-break among equals ...
        order.sort(key=load.__getitem__)      # ... stable sort: least loaded first
        thr = load[order[C - 1]]
        chosen = [w for w in order if load[w] < thr]
        free = [w for w in order if load[w] == thr]
        score = [0] * M
        for w in chosen:
            row = pair[w]
            for v in free:
                score[v] += row[v]
        for _ in range(C - len(chosen)):
            best = min(free, key=score.__getitem__)
            free.remove(best)
            chosen.append(best)
            row = pair[best]
            for v in free:
                score[v] += row[v]
        for w in chosen:
            load[w] += 1
            row = pair[w]
            for v in chosen:
                row[v] += 1
            per_worker[w].append(s)
    if n <= 64 * M:  # only a small N can leave two workers with identical samples
        _break_equal_workers(per_worker, pair, n)
    return per_worker


def _break_equal_workers(per_worker: list[list[int]], pair: list[list[int]], n: int) -> None:
    """Repair pass for small N: when the greedy leaves two workers a, b holding identical
    samples (it can at the end of a round, when the last least-loaded workers are forced
    together), swap one membership: sample s (held by a and b) goes from a to a worker c that
    holds a sample t that a lacks, and t goes from c to a. Loads and copies are unchanged; the
    swap with the smallest increase of the sum of squared pair counts is taken."""
    M = len(per_worker)
    holders: list[list[int]] = [[] for _ in range(n)]
    for w, samples in enumerate(per_worker):
        for s in samples:
            holders[s].append(w)
    for _ in range(4 * M):
        seen: dict[tuple, int] = {}
        dup = None
        for w, samples in enumerate(per_worker):
            key = tuple(sorted(samples))
            if key in seen:
                dup = (seen[key], w)
                break
            seen[key] = w
        if dup is None:
            return
        a = dup[0]
        held = set(per_worker[a])
        best = None
        for s in per_worker[a]:
            xs = [x for x in holders[s] if x != a]
            for t in range(n):
                if t in held:
                    continue
                for c in holders[t]:
                    if c in holders[s]:
                        continue
                    ys = [y for y in holders[t] if y != c]
                    # pairs (a,x),(c,y) lost; (c,x),(a,y) gained: change of the sum of squares
                    delta = sum(2 * (pair[c][x] - pair[a][x]) + 2 for x in xs) + \
                        sum(2 * (pair[a][y] - pair[c][y]) + 2 for y in ys)
                    if best is None or delta < best[0]:
                        best = (delta, s, t, c, xs, ys)
        if best is None:
            return
        _, s, t, c, xs, ys = best
        for x in xs:
            pair[a][x] -= 1; pair[x][a] -= 1; pair[c][x] += 1; pair[x][c] += 1  # noqa: E702
        for y in ys:
            pair[c][y] -= 1; pair[y][c] -= 1; pair[a][y] += 1; pair[y][a] += 1  # noqa: E702
        holders[s][holders[s].index(a)] = c
        holders[t][holders[t].index(c)] = a
        per_worker[a][per_worker[a].index(s)] = t
        per_worker[c][per_worker[c].index(t)] = s


def assign(layout: Layout, n: int) -> Assignment:
    """Assign N training samples (positions 0..N-1) to the layout's workers. Pure and seeded:
    the same (layout, n) always gives the same assignment."""
    check_sample_count(layout, n)
    M, C = layout.workers, layout.copies
    rng = np.random.default_rng(np.random.SeedSequence([layout.seed, 2]))
    perm = rng.permutation(n) if layout.shuffle else np.arange(n)

    def pieces(p: int) -> list[np.ndarray]:
        b = _bounds(n, p)
        return [perm[b[j]:b[j + 1]] for j in range(p)]

    s = layout.scheme
    if s == "full_overlap":
        members = [perm for _ in range(M)]
    elif s == "disjoint":
        members = pieces(M)
    elif s == "coarse":
        sh = pieces(layout.shards)
        members = [sh[i % layout.shards] for i in range(M)]
    elif s == "medium_coarse":
        sh = pieces(M)
        members = [np.concatenate([sh[(i + k) % M] for k in range(C)]) for i in range(M)]
    elif s == "fine_grained":
        if C == M:
            members = [perm for _ in range(M)]
        else:
            fg = _fine_grained(n, M, C, _seed_of(layout.seed, 3))
            members = [perm[np.asarray(w, dtype=np.int64)] for w in fg]
    else:  # households / neighbourhoods
        W = M // layout.households
        sh = pieces(layout.household_shards * W)
        members = [sh[((i // W) % layout.household_shards) * W + i % W] for i in range(M)]

    seeds = worker_seeds(layout)
    members = [np.random.default_rng(seeds[i]).permutation(np.asarray(m, dtype=np.int64))
               for i, m in enumerate(members)]
    return Assignment(layout=layout, n=n, members=members, seeds=seeds, groups=worker_groups(layout))


def id_ranges(ids: np.ndarray) -> list[list[int]]:
    """Sorted inclusive ``[first, last]`` ranges covering exactly the given (unique) ids."""
    a = np.unique(np.asarray(ids, dtype=np.int64))
    if a.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(a) != 1)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [a.size - 1]])
    return [[int(a[s]), int(a[e])] for s, e in zip(starts, ends)]


def expand_ranges(ranges: list[list[int]]) -> np.ndarray:
    """Inverse of :func:`id_ranges`."""
    if not ranges:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b + 1, dtype=np.int64) for a, b in ranges])
