"""The cost model of a cluster: what a step's compute, a collective and a message cost in time on a
modelled cluster, for the simulated clock (:mod:`.simclock`). Pure functions of their inputs: no
clock, no threads, no torch.

**The cluster** (:class:`Cluster`): ``nodes`` x ``ranks_per_node`` ranks, placed in blocks (rank r on
node ``r // ranks_per_node``, as Horovod's and torchrun's local ranks are), an ``intra`` link between
ranks of one node and an ``inter`` link between nodes, each a latency alpha (seconds) and a bandwidth
beta (bytes per second). Every node has one network interface: concurrent flows that leave (or enter)
a node through it share its bandwidth equally (``k`` flows: beta / k each). Intra-node pairs do not
share (NVLink behind an NVSwitch, or shared memory).

**Collectives** are costed as their backend performs them (``backend`` gloo | nccl), for a group of M
ranks spanning N nodes, n the payload bytes of one rank:

* ring allreduce (gloo's ``allreduce``: ``UNSPECIFIED`` and ``RING`` both run ``ring()``, a
  reduce-scatter then an allgather around the ring, gloo/allreduce.cc; NCCL's Ring):
  ``2(M-N) alpha_intra + 2(N-1) alpha_inter + 2(M-1)/M n / beta_ring``: 2(M-1) latencies of which
  2(N-1) cross nodes (NCCL src/graph/tuning.cc: ``(nsteps - nInterSteps) * intraLat +
  nInterSteps * interLat`` with ``nsteps = 2(nRanks-1)``, ``nInterSteps = 2(nNodes-1)``), and each
  rank's 2(M-1)/M n bytes over the slowest hop of the ring (``beta_ring``: its bandwidth over the
  flows sharing it);
* tree allreduce (NCCL's Tree, a double binary tree across nodes and a chain inside a node):
  ``2((P-1) alpha_intra + floor(log2 N) alpha_inter) + 2 n / beta`` (tuning.cc: latency
  ``2 * ((nRanks/nNodes-1) * intraLat + log2i(nNodes) * interLat)``, algorithm bandwidth half the
  bus bandwidth), P the ranks per node of the group, beta the inter link when N > 1;
* NCCL picks, per call, the algorithm its model prices lowest (``ncclTopoGetAlgoTime``): ``auto``
  with nccl is the cheaper of ring and tree; with gloo it is the ring (gloo has no tree allreduce);
* hierarchical allreduce (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``: NCCL reduce-scatter inside
  the node, an allreduce across nodes, NCCL allgather inside the node,
  horovod/common/ops/nccl_operations.cc ``NCCLHierarchicalAllreduce``):
  ``2[(P-1) alpha_intra + (P-1)/P n / beta_intra] + 2(N-1) alpha_inter + 2(N-1)/N n / beta_inter``:
  the P ranks of a node each allreduce n/P bytes across nodes at once, sharing the node's interface;
* broadcast: gloo's binomial tree (gloo/broadcast.cc: ``ceil(log2 M)`` rounds, each a full copy of
  the n bytes from every rank that has them to one that has not), each round as long as its slowest
  transfer; NCCL's pipelined ring: ``(M-N) alpha_intra + (N-1) alpha_inter + n / beta_ring``;
* allgather (a ring in both): ``(M-N) alpha_intra + (N-1) alpha_inter + (M-1) n / beta_ring``;
* gather to a root: every rank sends its n bytes to the root at once; the flows from other nodes
  share the root's interface;
* barrier: a zero-byte ring allreduce (its latencies only);
* point to point: ``alpha + n / beta`` of the link between the two ranks (``k`` flows sharing an
  interface: ``alpha + k n / beta``).

Concurrent flows whose start times differ share a link by processor sharing
(:func:`fair_share_finish`): at every moment the active flows split the bandwidth equally.

**Compute** (:class:`~.compute_profile.ComputeProfile`): a step's seconds per local batch size, measured on this
machine (:func:`~.compute_profile.measure_profile`: a short timed warm-up, then the median of timed steps, per batch
size) or given for named hardware with the source of the numbers.

**Output per run** (:class:`Ledger`): virtual wall time, the share of the ranks' time spent in
communication, and the bytes that crossed each link.

The default of the training config is the flat model the clock charged before this module
(:class:`FlatCost`: every collective and message ``latency_s + bytes / bytes_per_s``).

Not modelled: congestion inside switches (a full-bisection fabric is assumed), NCCL's protocols
(LL, LL128, Simple) and channel counts, CollNet/NVLS/SHARP, gloo's segment pipelining beyond the
formulas above, compression, and overlap of compute with communication (the clock charges each
where the code runs it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

BACKENDS = ("gloo", "nccl")
ALLREDUCE_ALGORITHMS = ("auto", "ring", "tree", "hierarchical")


def check_number(name: str, value: float, positive: bool) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name}={value!r}: must be a finite number {'> 0' if positive else '>= 0'}")
    return v


@dataclass(frozen=True)
class Link:
    """One kind of link: latency (s) and bandwidth (bytes/s)."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        check_number("latency_s", self.latency_s, positive=False)
        check_number("bytes_per_s", self.bytes_per_s, positive=True)

    def seconds(self, nbytes: float, flows: int = 1) -> float:
        """One transfer of ``nbytes`` while ``flows`` equal flows (this one included) share the link."""
        return self.latency_s + float(nbytes) * max(1, int(flows)) / self.bytes_per_s


@dataclass(frozen=True)
class Preset:
    """A named link technology: the network between nodes, the link inside a node, and their sources."""

    name: str
    inter: Link
    intra: Link
    source: str


# Bandwidths are what a transfer's payload gets, not the line rate. Ethernet: TCP over IPv4 with a
# 1500-byte MTU carries 1460 payload bytes per 1538 bytes on the wire (preamble, header, FCS,
# inter-frame gap): 94.93 % of the line rate (a2o.si, "Ethernet/IP/TCP bitrate vs. packet size vs.
# segment size vs. efficiency vs. speed", 2015). Inside a node (the CPU presets): ranks on one host
# exchange through loopback / shared memory, taken as 1 GB/s and 10 us (an assumption of this model,
# of the order this machine's loopback gloo shows; replace it with a measured value for a real host).
_HOST = Link(latency_s=10e-6, bytes_per_s=1e9)
PRESETS: dict[str, Preset] = {
    "gbe1": Preset(
        "gbe1", inter=Link(latency_s=50e-6, bytes_per_s=1e9 / 8 * 1460 / 1538), intra=_HOST,
        source="1 Gbit/s Ethernet: 118.7 MB/s TCP payload (94.93 % of the line rate, a2o.si 2015); "
               "latency 50 us one way: an assumption (kernel TCP with interrupt coalescing; 2.5x the "
               "20 us measured on tuned 10 GbE by Hurwitz & Feng, Hot Interconnects 11, 2003)"),
    "gbe10": Preset(
        "gbe10", inter=Link(latency_s=20e-6, bytes_per_s=10e9 / 8 * 1460 / 1538), intra=_HOST,
        source="10 Gbit/s Ethernet: 1.187 GB/s TCP payload (94.93 % of the line rate, a2o.si 2015); "
               "20 us end-to-end application latency (Hurwitz & Feng, 'Initial end-to-end performance "
               "evaluation of 10-Gigabit Ethernet', Hot Interconnects 11, 2003)"),
    "ib100": Preset(
        "ib100", inter=Link(latency_s=0.5e-6, bytes_per_s=100e9 / 8), intra=_HOST,
        source="InfiniBand EDR 4x: 100 Gbit/s effective data rate (4 lanes x 25.78125 Gbit/s, 64b/66b "
               "encoding; Mellanox ConnectX-5 Ex user manual, 'InfiniBand EDR'); 0.5 us latency (the "
               "EDR figure of the ArchWiki InfiniBand page: SDR 5, DDR 2.5, QDR 1.3, FDR 0.7, EDR 0.5 us)"),
    "nvlink": Preset(
        "nvlink", inter=Link(latency_s=0.5e-6, bytes_per_s=100e9 / 8),
        intra=Link(latency_s=0.47e-6, bytes_per_s=300e9),
        source="NVLink 3 inside a node (A100: 12 links, 600 GB/s both directions = 300 GB/s each way; "
               "NVIDIA, nvidia.com/data-center/nvlink); latency 0.47 us, NCCL's own NVLink ring "
               "latency (src/graph/tuning.cc hwLat, NVLINK Ring/LL); nodes joined by InfiniBand EDR "
               "as the ib100 preset"),
}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r} (one of {', '.join(PRESETS)})") from None


@dataclass(frozen=True)
class Cost:
    """What one collective or message costs: its seconds, and the bytes it put on each link
    (``node{a}->node{b}`` between nodes, ``node{a}`` inside a node)."""

    seconds: float
    link_bytes: Mapping[str, float] = field(default_factory=dict)


def _add(acc: dict, key: str, nbytes: float) -> None:
    if nbytes:
        acc[key] = acc.get(key, 0.0) + float(nbytes)


@dataclass(frozen=True)
class Cluster:
    """The modelled cluster (module docstring)."""

    nodes: int
    ranks_per_node: int
    inter: Link
    intra: Link
    backend: str = "gloo"
    allreduce_algorithm: str = "auto"

    def __post_init__(self) -> None:
        if int(self.nodes) < 1 or int(self.ranks_per_node) < 1:
            raise ValueError(f"nodes={self.nodes}, ranks_per_node={self.ranks_per_node}: both must be >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: one of {', '.join(BACKENDS)}")
        if self.allreduce_algorithm not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"allreduce={self.allreduce_algorithm!r}: one of {', '.join(ALLREDUCE_ALGORITHMS)}")
        if self.allreduce_algorithm == "tree" and self.backend != "nccl":
            raise ValueError("allreduce='tree' needs backend nccl (gloo's allreduce is a ring)")

    @classmethod
    def from_preset(cls, name: str, nodes: int, ranks_per_node: int, **kw) -> "Cluster":
        p = preset(name)
        return cls(nodes, ranks_per_node, p.inter, p.intra, **kw)

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        r = int(rank)
        if not 0 <= r < self.size:
            raise ValueError(f"rank {r} outside the cluster of {self.nodes} x {self.ranks_per_node} ranks")
        return r // self.ranks_per_node

    def link(self, a: int, b: int) -> Link:
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def link_name(self, a: int, b: int) -> str:
        na, nb = self.node_of(a), self.node_of(b)
        return f"node{na}" if na == nb else f"node{na}->node{nb}"

    # ------------------------------------------------------------------ building blocks
    def _ranks(self, ranks: Iterable[int]) -> list[int]:
        rs = sorted(int(r) for r in ranks)
        if not rs or len(set(rs)) != len(rs):
            raise ValueError(f"a group needs distinct ranks, got {list(ranks)}")
        for r in rs:
            self.node_of(r)
        return rs

    def _flows(self, pairs: Sequence[tuple[int, int]]) -> list[int]:
        """For each (src, dst) of transfers running at once: how many of them share its bottleneck
        (the source's interface out or the destination's interface in; 1 inside a node)."""
        out: dict[int, int] = {}
        inn: dict[int, int] = {}
        for a, b in pairs:
            na, nb = self.node_of(a), self.node_of(b)
            if na != nb:
                out[na] = out.get(na, 0) + 1
                inn[nb] = inn.get(nb, 0) + 1
        return [1 if self.node_of(a) == self.node_of(b)
                else max(out[self.node_of(a)], inn[self.node_of(b)]) for a, b in pairs]

    def _ring(self, rs: list[int]) -> tuple[float, float, list[tuple[int, int]]]:
        """A ring over ``rs`` (in rank order): the sum of one lap's hop latencies less one hop per
        node, as NCCL counts them ((M-N) intra + (N-1) inter), its effective bandwidth (the slowest
        hop over its sharing) and its hops."""
        m = len(rs)
        hops = [(rs[i], rs[(i + 1) % m]) for i in range(m)]
        n_nodes = len({self.node_of(r) for r in rs})
        latency = (m - n_nodes) * self.intra.latency_s + (n_nodes - 1) * self.inter.latency_s
        flows = self._flows(hops)
        beta = min(self.link(a, b).bytes_per_s / k for (a, b), k in zip(hops, flows))
        return latency, beta, hops

    def _ring_bytes(self, hops, per_hop: float) -> dict:
        acc: dict = {}
        for a, b in hops:
            _add(acc, self.link_name(a, b), per_hop)
        return acc

    # ------------------------------------------------------------------ collectives
    def ring_allreduce(self, ranks: Iterable[int], nbytes: float) -> Cost:
        rs = self._ranks(ranks)
        m = len(rs)
        if m == 1:
            return Cost(0.0)
        lat, beta, hops = self._ring(rs)
        moved = 2 * (m - 1) / m * float(nbytes)
        return Cost(2 * lat + moved / beta, self._ring_bytes(hops, moved))

    def tree_allreduce(self, ranks: Iterable[int], nbytes: float) -> Cost:
        rs = self._ranks(ranks)
        m = len(rs)
        if m == 1:
            return Cost(0.0)
        nodes = sorted({self.node_of(r) for r in rs})
        per_node = max(sum(1 for r in rs if self.node_of(r) == nd) for nd in nodes)
        n = len(nodes)
        lat = 2 * ((per_node - 1) * self.intra.latency_s + int(math.log2(n)) * self.inter.latency_s)
        beta = self.inter.bytes_per_s if n > 1 else self.intra.bytes_per_s
        acc: dict = {}
        for nd in nodes:     # a chain inside each node: every rank but the last sends n up and gets n down
            _add(acc, f"node{nd}", 2 * float(nbytes) * (sum(1 for r in rs if self.node_of(r) == nd) - 1))
        for i, nd in enumerate(nodes[1:], 1):   # the trees' edges between nodes: n up, n down each
            _add(acc, f"node{nd}->node{nodes[(i - 1) // 2]}", float(nbytes))
            _add(acc, f"node{nodes[(i - 1) // 2]}->node{nd}", float(nbytes))
        return Cost(lat + 2 * float(nbytes) / beta, acc)

    def hierarchical_allreduce(self, ranks: Iterable[int], nbytes: float) -> Cost:
        rs = self._ranks(ranks)
        by_node: dict[int, list[int]] = {}
        for r in rs:
            by_node.setdefault(self.node_of(r), []).append(r)
        p = max(len(v) for v in by_node.values())
        if len(by_node) == 1 or p == 1:
            return self.ring_allreduce(rs, nbytes)
        n, x = len(by_node), float(nbytes)
        intra = 2 * ((p - 1) * self.intra.latency_s + (p - 1) / p * x / self.intra.bytes_per_s)
        # p concurrent allreduces of x / p bytes across the n nodes share each node's interface
        inter = 2 * (n - 1) * self.inter.latency_s + 2 * (n - 1) / n * (x / p) * p / self.inter.bytes_per_s
        acc: dict = {}
        nodes = sorted(by_node)
        for nd in nodes:
            _add(acc, f"node{nd}", 2 * (len(by_node[nd]) - 1) / len(by_node[nd]) * x * len(by_node[nd]))
        for i, nd in enumerate(nodes):
            _add(acc, f"node{nd}->node{nodes[(i + 1) % n]}", 2 * (n - 1) / n * x)
        return Cost(intra + inter, acc)

    def allreduce(self, ranks: Iterable[int], nbytes: float) -> Cost:
        """The allreduce the backend would run (``allreduce_algorithm``; module docstring)."""
        algo = self.allreduce_algorithm
        if algo == "ring" or (algo == "auto" and self.backend == "gloo"):
            return self.ring_allreduce(ranks, nbytes)
        if algo == "tree":
            return self.tree_allreduce(ranks, nbytes)
        if algo == "hierarchical":
            return self.hierarchical_allreduce(ranks, nbytes)
        ring, tree = self.ring_allreduce(ranks, nbytes), self.tree_allreduce(ranks, nbytes)
        return tree if tree.seconds < ring.seconds else ring

    def broadcast(self, ranks: Iterable[int], nbytes: float, root: int) -> Cost:
        rs = self._ranks(ranks)
        if int(root) not in rs:
            raise ValueError(f"broadcast root {root} is not in the group {rs}")
        m, x = len(rs), float(nbytes)
        if m == 1:
            return Cost(0.0)
        if self.backend == "nccl":
            start = rs.index(int(root))
            chain = rs[start:] + rs[:start]
            hops = list(zip(chain[:-1], chain[1:]))
            n_nodes = len({self.node_of(r) for r in rs})
            lat = (m - n_nodes) * self.intra.latency_s + (n_nodes - 1) * self.inter.latency_s
            beta = min(self.link(a, b).bytes_per_s / k for (a, b), k in zip(hops, self._flows(hops)))
            return Cost(lat + x / beta, self._ring_bytes(hops, x))
        # gloo: binomial tree over virtual ranks (rank - root) mod M, gloo/broadcast.cc
        vroot = rs.index(int(root))
        total, acc = 0.0, {}
        for i in range(math.ceil(math.log2(m))):
            # round i: the virtual ranks below 2^i have the bytes; v sends to v + 2^i
            pairs = [(rs[(v + vroot) % m], rs[(v + (1 << i) + vroot) % m])
                     for v in range(1 << i) if v + (1 << i) < m]
            flows = self._flows(pairs)
            total += max(self.link(a, b).seconds(x, k) for (a, b), k in zip(pairs, flows))
            for a, b in pairs:
                _add(acc, self.link_name(a, b), x)
        return Cost(total, acc)

    def allgather(self, ranks: Iterable[int], nbytes_each: float) -> Cost:
        rs = self._ranks(ranks)
        m = len(rs)
        if m == 1:
            return Cost(0.0)
        lat, beta, hops = self._ring(rs)
        moved = (m - 1) * float(nbytes_each)
        return Cost(lat + moved / beta, self._ring_bytes(hops, moved))

    def gather(self, ranks: Iterable[int], nbytes_each: float, root: int) -> Cost:
        rs = self._ranks(ranks)
        if int(root) not in rs:
            raise ValueError(f"gather root {root} is not in the group {rs}")
        pairs = [(r, int(root)) for r in rs if r != int(root)]
        if not pairs:
            return Cost(0.0)
        flows = self._flows(pairs)
        acc: dict = {}
        for a, b in pairs:
            _add(acc, self.link_name(a, b), float(nbytes_each))
        return Cost(max(self.link(a, b).seconds(nbytes_each, k) for (a, b), k in zip(pairs, flows)), acc)

    def barrier(self, ranks: Iterable[int]) -> Cost:
        return Cost(self.ring_allreduce(ranks, 0).seconds)

    def concurrent(self, src: int, dst: int, in_flight: Iterable[tuple[int, int]]) -> int:
        """How many flows a new message ``src -> dst`` shares its bottleneck with, itself included,
        while the messages ``in_flight`` (src, dst) are in transit: 1 inside a node, else 1 + the
        larger of those leaving ``src``'s node and those entering ``dst``'s node across nodes."""
        na, nb = self.node_of(src), self.node_of(dst)
        if na == nb:
            return 1
        pairs = [(self.node_of(a), self.node_of(b)) for a, b in in_flight]
        return 1 + max(sum(1 for x, y in pairs if x == na and y != na), sum(1 for x, y in pairs if y == nb and x != nb))

    def p2p(self, src: int, dst: int, nbytes: float, flows: int = 1) -> Cost:
        if int(src) == int(dst):
            raise ValueError(f"a message from rank {src} to itself")
        return Cost(self.link(src, dst).seconds(nbytes, flows), {self.link_name(src, dst): float(nbytes)})


@dataclass(frozen=True)
class FlatCost:
    """The clock's model before the cluster model (and the default): every collective and message
    costs ``latency_s + bytes / bytes_per_s``, with the calling rank's payload bytes."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        check_number("latency_s", self.latency_s, positive=False)
        check_number("bytes_per_s", self.bytes_per_s, positive=True)

    def _c(self, nbytes: float) -> Cost:
        return Cost(self.latency_s + float(nbytes) / self.bytes_per_s)      # no links: no bytes per link

    def allreduce(self, ranks, nbytes):
        return self._c(nbytes)

    def broadcast(self, ranks, nbytes, root):
        return self._c(nbytes)

    def allgather(self, ranks, nbytes_each):
        return self._c(nbytes_each)

    def gather(self, ranks, nbytes_each, root):
        return self._c(nbytes_each)

    def barrier(self, ranks):
        return self._c(0)

    def concurrent(self, src, dst, in_flight) -> int:
        return 1

    def p2p(self, src, dst, nbytes, flows: int = 1):
        return self._c(nbytes)


def fair_share_finish(bytes_per_s: float, latency_s: float, flows: Sequence[tuple[float, float]]) -> list[float]:
    """Finish times of flows ``(start_s, nbytes)`` on one link of ``bytes_per_s`` shared by processor
    sharing (the active flows split the bandwidth equally at every moment), each plus the latency."""
    beta = check_number("bytes_per_s", bytes_per_s, positive=True)
    lat = check_number("latency_s", latency_s, positive=False)
    left = {i: float(n) for i, (_, n) in enumerate(flows)}
    starts = sorted((float(s), i) for i, (s, _) in enumerate(flows))
    done: dict[int, float] = {}
    active: set[int] = set()
    t, k = (starts[0][0] if starts else 0.0), 0
    while len(done) < len(flows):
        while k < len(starts) and starts[k][0] <= t:
            i = starts[k][1]
            k += 1
            if left[i] <= 0:
                done[i] = t
            else:
                active.add(i)
        if not active:
            if k < len(starts):
                t = starts[k][0]
            continue
        rate = beta / len(active)
        first_end = t + min(left[i] for i in active) / rate
        nxt = starts[k][0] if k < len(starts) else math.inf
        until = min(first_end, nxt)
        for i in list(active):
            left[i] -= rate * (until - t)
            if until == first_end and left[i] <= 1e-9 * max(1.0, float(flows[i][1])):
                active.discard(i)
                done[i] = until
        t = until
    return [done[i] + lat for i in range(len(flows))]


# ---------------------------------------------------------------------- a run's account
class Ledger:
    """What a run spent: per rank the compute and communication seconds, and the bytes on each link."""

    def __init__(self) -> None:
        self.compute_s: dict[int, float] = {}
        self.comm_s: dict[int, float] = {}
        self.link_bytes: dict[str, float] = {}

    def compute(self, rank: int, seconds: float) -> None:
        self.compute_s[rank] = self.compute_s.get(rank, 0.0) + float(seconds)

    def comm(self, rank: int, seconds: float, cost: Optional[Cost] = None) -> None:
        """``rank`` spent ``seconds`` in communication; ``cost``'s bytes are counted once (pass it
        from one rank of a collective only)."""
        self.comm_s[rank] = self.comm_s.get(rank, 0.0) + float(seconds)
        for k, v in (cost.link_bytes if cost is not None else {}).items():
            _add(self.link_bytes, k, v)

    def summary(self, virtual_s: float) -> dict:
        busy = sum(self.compute_s.values()) + sum(self.comm_s.values())
        return {"virtual_s": round(float(virtual_s), 9),
                "comm_share": round(sum(self.comm_s.values()) / busy, 6) if busy else 0.0,
                "bytes_per_link": {k: int(round(v)) for k, v in sorted(self.link_bytes.items())}}
