"""Point-to-point messages for the asynchronous algorithms, on process groups of their own.

The asynchronous algorithms (AD-PSGD, EA-wild, asynchronous parameter server) talk from
background threads while the training thread keeps using the world communicator for
evaluation and bookkeeping. torch.distributed process groups must not be driven from two
threads at once, and gloo's receive-from-any-source can miss a header from one peer while
another is being served (a hang under load; docs/async.md), so :class:`P2PChannel` creates **one gloo
group per communicating pair** (``dist.new_group([a, b])``; a collective: every rank creates
the channel with the same pair list at the same point). Each pair's group is used by exactly
one thread in each of its two processes: the serving side (a passive AD-PSGD worker, the
centre holder) runs one small serving thread per client (:mod:`.round_server`), each blocked on
a receive from that one client, so no receive from any source is needed.

Messages are a 4-integer header (``kind, round, a, b``) optionally followed by one flat tensor
whose size both sides know: only tensors travel (anything else is refused with a TypeError),
nothing is pickled. Tensors travel through host memory (gloo), whatever the model's device.

Slow is not dead: an operation waits for a slow peer without a bound (the pair groups' timeout
is a year). A peer that died closes its connections, which fails the operation at once; a
frozen or unreachable one stops its heartbeats (:mod:`.liveness`), which the waiting side
checks. Either way the error is a :class:`PeerError` naming both ranks and, when a heartbeat
went silent anywhere, the rank that did.

The algorithms open their channels with :func:`open_channel`: gloo's :class:`P2PChannel`, or the
communicator's own where it has them (the ranks of one simulated process, :class:`SimChannel`:
the same messages delivered through :mod:`.simclock`'s mailboxes after their virtual delay).
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist

# message kinds (header[0])
REQ, END, LEAVE, PUSH, ACQUIRE = 1, 2, 3, 4, 5
# a pair group's own timeout: waiting for a slow peer has no practical bound (liveness is separate)
PAIR_TIMEOUT = timedelta(days=365)


class PeerError(RuntimeError):
    """A peer of an asynchronous exchange failed, left the job or went silent."""


def _tensor(t, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"P2PChannel.{what}: got a {type(t).__module__}.{type(t).__name__}; only tensors travel "
                        "between workers (nothing is pickled)")
    return t


class P2PChannel:
    """One gloo group per pair in ``pairs`` (see module docstring); this rank uses its own pairs.
    ``liveness`` (a :class:`~.liveness.Liveness`) explains a failed operation: which rank went silent."""

    def __init__(self, pairs: Iterable[tuple[int, int]], liveness=None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the asynchronous algorithms need torch.distributed (launcher=torch or local)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.liveness = liveness
        self.groups: dict[int, object] = {}
        for a, b in sorted({tuple(sorted((int(a), int(b)))) for a, b in pairs}):
            g = dist.new_group([a, b], timeout=PAIR_TIMEOUT, backend="gloo")
            if self.rank in (a, b):
                self.groups[b if self.rank == a else a] = g
        self.peers = sorted(self.groups)
        if liveness is not None:
            liveness.watch(self.peers)
        self.bytes_sent = 0
        self.messages = 0
        self._count = threading.Lock()

    def failure(self, what: str, peer: int, e: Optional[BaseException] = None) -> PeerError:
        """The PeerError of a failed ``what`` with ``peer``: both ranks, the cause, and which rank's
        heartbeat went silent (when one did)."""
        text = (str(e).splitlines()[0] if str(e) else "")[:160] if e is not None else ""
        cause = f" ({type(e).__name__}: {text})" if e is not None else ""
        why = self.liveness.explain() if self.liveness is not None else None
        return PeerError(f"rank {self.rank}: {what} with rank {peer} failed{cause}; "
                         + (why or f"rank {peer} died or closed its connection"))

    def _group(self, peer: int):
        try:
            return self.groups[peer]
        except KeyError:
            raise PeerError(f"rank {self.rank}: no channel to rank {peer}") from None

    def _send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t, dst, group=self._group(dst))

    def _recv(self, t: torch.Tensor, src: int) -> None:
        dist.recv(t, src, group=self._group(src))

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = _tensor(t, "send").detach().to("cpu").contiguous()
        try:
            self._send(t, dst)
        except PeerError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with both ranks named
            raise self.failure("send", dst, e) from e
        with self._count:
            self.bytes_sent += t.numel() * t.element_size()
            self.messages += 1

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Receive into the CPU tensor ``t`` from ``src``."""
        _tensor(t, "recv")
        try:
            self._recv(t, src)
        except PeerError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self.failure("receive", src, e) from e

    def send_header(self, dst: int, kind: int, rnd: int = 0, a: int = 0, b: int = 0) -> None:
        self.send(torch.tensor([kind, rnd, a, b], dtype=torch.int64), dst)

    def recv_header(self, src: int) -> tuple[int, int, int, int]:
        """(kind, round, a, b) of the next header from ``src``."""
        h = torch.zeros(4, dtype=torch.int64)
        self.recv(h, src)
        kind, rnd, a, b = (int(v) for v in h.tolist())
        return kind, rnd, a, b

    def stats(self) -> dict:
        with self._count:
            return {"p2p_bytes_sent": self.bytes_sent, "p2p_messages": self.messages}


class SimChannel(P2PChannel):
    """The pair channels of ranks in one simulated process (:mod:`.simclock`): the same messages, byte
    counts and errors as :class:`P2PChannel`, delivered through the simulation's mailboxes after their
    virtual delay instead of gloo."""

    def __init__(self, mail, rank: int, world_size: int, pairs: Iterable[tuple[int, int]], liveness=None) -> None:
        self.mail, self.rank, self.world_size, self.liveness = mail, int(rank), int(world_size), liveness
        self.groups = {}
        for a, b in sorted({tuple(sorted((int(a), int(b)))) for a, b in pairs}):
            if self.rank in (a, b):
                self.groups[b if self.rank == a else a] = (a, b)
        self.peers = sorted(self.groups)
        self.bytes_sent = 0
        self.messages = 0
        self._count = threading.Lock()

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self._group(dst)
        self.mail.put(self.rank, dst, t.clone())

    def _recv(self, t: torch.Tensor, src: int) -> None:
        self._group(src)
        got = self.mail.get(src, self.rank)
        if got.numel() != t.numel() or got.dtype != t.dtype:
            raise PeerError(f"rank {self.rank}: a message of {got.numel()} {got.dtype} from rank {src} where "
                            f"{t.numel()} {t.dtype} were expected")
        t.copy_(got.view_as(t))


def open_channel(comm, pairs: Iterable[tuple[int, int]], liveness=None) -> P2PChannel:
    """The pair channels of ``comm``'s rank: the communicator's own when it has them (a simulated
    in-process world), else gloo's (:class:`P2PChannel`; collective, see module docstring)."""
    make = getattr(comm, "p2p_channel", None)
    return make(pairs, liveness) if make is not None else P2PChannel(pairs, liveness)
