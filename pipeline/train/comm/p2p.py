"""Point-to-point messages for the asynchronous algorithms, on process groups of their own.

The asynchronous algorithms (AD-PSGD, EA-wild, asynchronous parameter server) talk from
background threads while the training thread keeps using the world communicator for
evaluation and bookkeeping. torch.distributed process groups must not be driven from two
threads at once, and gloo's receive-from-any-source was seen to miss a header from one peer
while another was being served (a hang under load), so :class:`P2PChannel` creates **one gloo
group per communicating pair** (``dist.new_group([a, b])``; a collective: every rank creates
the channel with the same pair list at the same point). Each pair's group is used by exactly
one thread in each of its two processes: the serving side (a passive AD-PSGD worker, the
centre holder) runs one small serving thread per client, each blocked on a receive from that
one client, so no receive from any source is needed.

Messages are a 4-integer header (``kind, round, a, b``) optionally followed by one flat tensor
whose size both sides know. Tensors travel through host memory (gloo), whatever the model's
device. Every operation has the group's timeout; a peer that died or stopped answering raises
:class:`PeerError` naming both ranks instead of hanging.

Why not torch RPC or Horovod: Horovod has only collectives (every rank in every call); torch
RPC works but adds a TensorPipe agent with its own rendezvous and thread pool next to the
training group, for what is a fixed request/response of one vector. ``docs/async.md`` has the
measured cost of this transport.
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

# message kinds (header[0])
REQ, END, LEAVE, PUSH, ACQUIRE = 1, 2, 3, 4, 5


class PeerError(RuntimeError):
    """A peer of an asynchronous exchange failed, left the job or timed out."""


class P2PChannel:
    """One gloo group per pair in ``pairs`` (see module docstring); this rank uses its own pairs."""

    def __init__(self, pairs: Iterable[tuple[int, int]], timeout_s: float = 60.0) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the asynchronous algorithms need torch.distributed (launcher=torch or local)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = float(timeout_s)
        self.groups: dict[int, object] = {}
        for a, b in sorted({tuple(sorted((int(a), int(b)))) for a, b in pairs}):
            g = dist.new_group([a, b], timeout=timedelta(seconds=self.timeout_s), backend="gloo")
            if self.rank in (a, b):
                self.groups[b if self.rank == a else a] = g
        self.bytes_sent = 0
        self.messages = 0
        self._count = threading.Lock()

    def _fail(self, what: str, peer: int, e: BaseException) -> PeerError:
        text = str(e).splitlines()[0] if str(e) else ""
        return PeerError(f"rank {self.rank}: {what} with rank {peer} failed ({type(e).__name__}: {text[:160]}); "
                         f"a peer died or stopped answering within {self.timeout_s:.0f} s")

    def _group(self, peer: int):
        try:
            return self.groups[peer]
        except KeyError:
            raise PeerError(f"rank {self.rank}: no channel to rank {peer}") from None

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().to("cpu").contiguous()
        try:
            dist.send(t, dst, group=self._group(dst))
        except PeerError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with both ranks named
            raise self._fail("send", dst, e) from e
        with self._count:
            self.bytes_sent += t.numel() * t.element_size()
            self.messages += 1

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Receive into the CPU tensor ``t`` from ``src``."""
        try:
            dist.recv(t, src, group=self._group(src))
        except PeerError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._fail("receive", src, e) from e

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
