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

How samples are cut: the N training samples (by their position p in 0..N-1: the order of the
training rows in the input) get a slot by a seeded bijection of [0, N) computed per sample (a
Feistel network, :mod:`pipeline.shards.permutation`; ``shuffle=True``, the default, so shards
are label-balanced even when ids are ordered by label; the identity with ``shuffle=False``), and
the slots are cut into P equal pieces (piece j = slots [floor(jN/P), floor((j+1)N/P))), so every
worker's sample count differs from every other's by at most one row (a window of C consecutive
pieces also differs by at most one). The fine-grained design is computed for the first
``FINE_GRAINED_PERIOD`` slots (N when smaller) and repeats. Each worker writes its samples in the
order of a second bijection keyed by the worker's own seed, so equal-data workers also hold their
rows in different orders. :class:`Router` computes all of this per sample, so the shard stage's
tasks route rows without any table of the samples; :func:`assign` is the same in memory.

Impossible layouts (C > M, S not dividing M, more shards than samples, H not dividing M, ...)
raise :class:`~pipeline.errors.ConfigError` naming the parameter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..errors import ConfigError
from .fine_grained import design
from .permutation import permute

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


#: the fine-grained design repeats with this period (rounded up to a multiple of M) when N is larger
FINE_GRAINED_PERIOD = 4096


@dataclass(frozen=True)
class Router:
    """Where each training sample goes, computed per sample from its position ``p`` in ``[0, N)``
    (the order of the training rows in the input) with no table of the samples: its slot is a
    keyed bijection of ``p`` (:func:`pipeline.shards.permutation.permute`; the identity without
    ``shuffle``), a row of ``table`` (C workers) is chosen from the slot (the slot's piece, or the
    slot modulo the fine-grained period), and a worker writes its samples in the order of a second
    bijection keyed by its own seed."""

    layout: Layout
    n: int
    table: np.ndarray              # (rows, C) int32: the workers of each piece / pattern row
    period: int                    # 0: rows are the P pieces of [0, N); > 0: slot modulo period
    seeds: tuple

    @classmethod
    def of(cls, layout: Layout, n: int) -> "Router":
        check_sample_count(layout, n)
        M, C, s = layout.workers, layout.copies, layout.scheme
        if s == "full_overlap" or (s == "fine_grained" and C == M):
            table, period = np.arange(M)[None, :], 0
        elif s == "fine_grained":
            period = n if n <= FINE_GRAINED_PERIOD else -(-FINE_GRAINED_PERIOD // M) * M
            rows = [[] for _ in range(period)]
            for w, held in enumerate(design(period, M, C, _seed_of(layout.seed, 3))):
                for slot in held:
                    rows[slot].append(w)
            table = np.array(rows)
        else:
            table, period = _piece_workers(layout), 0
        return cls(layout, n, np.asarray(table, np.int32).reshape(-1, C), period, tuple(worker_seeds(layout)))

    def slots(self, positions: np.ndarray) -> np.ndarray:
        p = np.asarray(positions, np.int64)
        return permute(p, self.n, _seed_of(self.layout.seed, 2)) if self.layout.shuffle else p

    def workers(self, positions: np.ndarray) -> np.ndarray:
        """(k, C) the workers holding each position."""
        slot = self.slots(positions)
        if self.period:
            return self.table[slot % self.period]
        pieces = len(self.table)
        return self.table[((slot + 1) * pieces - 1) // self.n]

    def order(self, positions: np.ndarray, worker: int) -> np.ndarray:
        """The write order keys of these positions in ``worker``'s shard (a bijection of [0, N))."""
        return permute(positions, self.n, self.seeds[worker])

    def sizes(self) -> np.ndarray:
        """Samples per worker, from the table alone."""
        M = self.layout.workers
        if self.period:
            q, r = divmod(self.n, self.period)
            return q * np.bincount(self.table.ravel(), minlength=M) + np.bincount(self.table[:r].ravel(), minlength=M)
        per_piece = np.diff(_bounds(self.n, len(self.table)))
        return np.bincount(self.table.ravel(), weights=np.repeat(per_piece, self.table.shape[1]),
                           minlength=M).astype(np.int64)


def _piece_workers(layout: Layout) -> np.ndarray:
    """The workers of each piece of the piece-based schemes (one row per piece)."""
    M, C, s = layout.workers, layout.copies, layout.scheme
    if s == "disjoint":
        return np.arange(M)[:, None]
    if s == "coarse":
        S = layout.shards
        return np.array([[j + k * S for k in range(M // S)] for j in range(S)])
    if s == "medium_coarse":
        return np.array([[(j - k) % M for k in range(C)] for j in range(M)])
    W, SH, H = M // layout.households, layout.household_shards, layout.households   # households / neighbourhoods
    return np.array([[(j // W + t * SH) * W + j % W for t in range(H // SH)] for j in range(SH * W)])


def assign(layout: Layout, n: int) -> Assignment:
    """Assign N training samples (positions 0..N-1) to the layout's workers, in memory (what the
    shard stage's tasks compute per row with :class:`Router`). Pure and seeded: the same
    (layout, n) always gives the same assignment."""
    router = Router.of(layout, n)
    pos = np.arange(n, dtype=np.int64)
    held = router.workers(pos)
    members = []
    for w in range(layout.workers):
        mine = pos[(held == w).any(axis=1)]
        members.append(mine[np.argsort(router.order(mine, w), kind="stable")])
    return Assignment(layout=layout, n=n, members=members, seeds=list(router.seeds), groups=worker_groups(layout))


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
