"""Communication graphs for decentralized training: who may talk to whom, and with what weight.

Pure functions of (graph kind, worker count, seed); no torch, no communication. Every
worker evaluates them locally and gets the same answer, which is what makes a
decentralized round consistent without any coordination message.

Graphs (:func:`make_graph`)
    ``complete``  every pair of workers is an edge.
    ``ring``      worker i talks to i-1 and i+1 (mod M).
    ``regular``   r-regular circulant graph: i talks to i +- 1, ..., i +- r//2, and to
                  i + M/2 when r is odd (needs M even). r = 2 is the ring, r = M-1 the
                  complete graph; r = 1 pairs i with i + M/2. For r >= 2 the graph
                  contains the ring.

Random matchings (:meth:`Graph.matching`)
    SwarmSGD pairs workers with a random (near-)perfect matching of the graph in every
    round. The generator is ``numpy.random.default_rng([seed, round])`` (PCG64 seeded
    through a SeedSequence), so the sequence is a pure function of (run seed, round):
    identical on every worker and on every rerun. Complete graph: a uniform random
    permutation paired off two by two. Other graphs: randomised greedy matching, retried
    until it matches floor(M/2) pairs, with a random rotation of the ring's edges as a
    fallback (a maximum matching; not needed in practice). With an odd worker count
    exactly one worker sits out the round (partner ``None``). A worker is never its own
    partner and has at most one partner (``partners[partners[i]] == i``).

Mixing matrices (:meth:`Graph.mixing_matrix`)
    D-PSGD's doubly stochastic matrix W with Metropolis-Hastings weights:
    ``W[i, j] = 1 / (1 + max(deg i, deg j))`` on edges, the rest on the diagonal. It is
    symmetric, so rows and columns sum to 1; for the complete graph every entry is 1/M,
    for a ring (M >= 3) the three non-zero entries of a row are 1/3.

Edge colouring (:meth:`Graph.exchange_rounds`)
    To apply W with pairwise exchanges (the only primitive that lets a worker talk to a
    neighbour, not to everyone), the edges are split into matchings; one exchange round
    per matching. Complete graphs use the round-robin (circle) schedule: M-1 rounds for
    even M, M for odd; other graphs a deterministic greedy colouring (ring: 2 or 3 rounds).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import numpy as np

from ..errors import ConfigError

GRAPH_KINDS = ("complete", "ring", "regular")

Partners = list[Optional[int]]


@dataclass(frozen=True)
class Graph:
    """An undirected simple graph on workers ``0..n-1`` (``neighbours[i]`` sorted)."""

    kind: str
    n: int
    neighbours: tuple[tuple[int, ...], ...]

    # ---- structure ----
    @cached_property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """Sorted edges ``(i, j)`` with ``i < j``."""
        return tuple((i, j) for i in range(self.n) for j in self.neighbours[i] if i < j)

    def degree(self, i: int) -> int:
        return len(self.neighbours[i])

    def has_edge(self, i: int, j: int) -> bool:
        return j in self.neighbours[i]

    # ---- random matchings (SwarmSGD) ----
    def matching(self, seed: int, round_index: int) -> Partners:
        """Partner of every worker in round ``round_index`` (``None``: sits out).

        A pure function of ``(seed, round_index)``: every worker computes the same list.
        """
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(round_index)])
        n = self.n
        partners: Partners = [None] * n
        if n < 2:
            return partners
        if self.kind == "complete":
            perm = rng.permutation(n)
            for a, b in zip(perm[0::2], perm[1::2]):
                partners[int(a)], partners[int(b)] = int(b), int(a)
            return partners
        want = n // 2
        for _ in range(32):
            cand = self._greedy_matching(rng)
            if sum(p is not None for p in cand) // 2 == want:
                return cand
        return self._ring_rotation_matching(int(rng.integers(n)))

    def _greedy_matching(self, rng: np.random.Generator) -> Partners:
        partners: Partners = [None] * self.n
        for i in rng.permutation(self.n):
            i = int(i)
            if partners[i] is not None:
                continue
            free = [j for j in self.neighbours[i] if partners[j] is None and j != i]
            if free:
                j = free[int(rng.integers(len(free)))]
                partners[i], partners[j] = j, i
        return partners

    def _ring_rotation_matching(self, offset: int) -> Partners:
        """Pairs (o, o+1), (o+2, o+3), ... of the ring; with odd n worker o-1 sits out."""
        n = self.n
        partners: Partners = [None] * n
        for k in range(n // 2):
            a, b = (offset + 2 * k) % n, (offset + 2 * k + 1) % n
            partners[a], partners[b] = b, a
        return partners

    # ---- mixing matrix (D-PSGD) ----
    def mixing_matrix(self) -> np.ndarray:
        """Symmetric doubly stochastic Metropolis-Hastings matrix supported on the graph."""
        n = self.n
        w = np.zeros((n, n), dtype=np.float64)
        for i, j in self.edges:
            w[i, j] = w[j, i] = 1.0 / (1.0 + max(self.degree(i), self.degree(j)))
        for i in range(n):
            w[i, i] = 1.0 - w[i].sum()
        return w

    # ---- exchange schedule (applying W with pairwise exchanges) ----
    def exchange_rounds(self) -> list[Partners]:
        """Split the edges into matchings; each is a partner list for one exchange round."""
        n = self.n
        if n < 2:
            return []
        if self.kind == "complete":
            return _round_robin(n)
        colour_of: dict[tuple[int, int], int] = {}
        used: list[set[int]] = [set() for _ in range(n)]
        for i, j in self.edges:
            c = 0
            while c in used[i] or c in used[j]:
                c += 1
            colour_of[(i, j)] = c
            used[i].add(c)
            used[j].add(c)
        rounds: list[Partners] = [[None] * n for _ in range(max(colour_of.values()) + 1)]
        for (i, j), c in colour_of.items():
            rounds[c][i], rounds[c][j] = j, i
        return rounds


def _round_robin(n: int) -> list[Partners]:
    """Circle-method schedule of the complete graph: every pair meets exactly once."""
    m = n if n % 2 == 0 else n + 1  # a phantom player for odd n
    players = list(range(m))
    rounds: list[Partners] = []
    for _ in range(m - 1):
        partners: Partners = [None] * n
        for k in range(m // 2):
            a, b = players[k], players[m - 1 - k]
            if a < n and b < n:
                partners[a], partners[b] = b, a
        rounds.append(partners)
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def make_graph(kind: str, n: int, degree: Optional[int] = None) -> Graph:
    """Build a communication graph; ``ConfigError`` names the bad value."""
    if n < 1:
        raise ConfigError(f"invalid worker count {n}: need at least 1 worker")
    if kind == "complete":
        nb = [tuple(j for j in range(n) if j != i) for i in range(n)]
    elif kind == "ring":
        nb = [tuple(sorted({(i - 1) % n, (i + 1) % n} - {i})) for i in range(n)]
    elif kind == "regular":
        if degree is None:
            raise ConfigError("topology 'regular' needs a degree (topology_degree)")
        r = int(degree)
        if not 1 <= r <= n - 1:
            raise ConfigError(f"invalid topology_degree={r} for {n} workers: need 1 <= degree <= {n - 1}")
        if r % 2 == 1 and n % 2 == 1:
            raise ConfigError(f"invalid topology_degree={r} for {n} workers: an odd degree needs an even worker count")
        offsets = list(range(1, r // 2 + 1))
        nb = []
        for i in range(n):
            s = {(i + o) % n for o in offsets} | {(i - o) % n for o in offsets}
            if r % 2 == 1:
                s.add((i + n // 2) % n)
            nb.append(tuple(sorted(s - {i})))
    else:
        raise ConfigError(f"unknown topology {kind!r}: expected one of {', '.join(GRAPH_KINDS)}")
    g = Graph(kind, n, tuple(nb))
    if kind == "regular":
        assert all(g.degree(i) == int(degree) for i in range(n)), "circulant construction broke regularity"
    return g


def check_partners(partners: Partners) -> None:
    """Raise ``ValueError`` unless ``partners`` is a valid matching (symmetric, no self-pairs)."""
    n = len(partners)
    for i, p in enumerate(partners):
        if p is None:
            continue
        if not 0 <= p < n:
            raise ValueError(f"worker {i} paired with nonexistent worker {p}")
        if p == i:
            raise ValueError(f"worker {i} paired with itself")
        if partners[p] != i:
            raise ValueError(f"worker {i} -> {p} but {p} -> {partners[p]}")
