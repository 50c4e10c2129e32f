"""Point-to-point messages for the asynchronous algorithms, on a process group of their own.

The asynchronous algorithms (AD-PSGD, EA-wild, asynchronous parameter server) talk from a
background thread (AD-PSGD, the centre holder) or from the training thread to a holder, while
the training thread keeps using the world communicator for evaluation and bookkeeping.
torch.distributed process groups are not safe to drive from two threads at once, so
:class:`P2PChannel` creates a **separate gloo group over the whole world** (``dist.new_group``,
a collective: every rank constructs the channel at the same point) that only ONE thread per
process uses. Tensors travel through host memory (gloo), whatever the device of the model:
the messages are one flat vector each way, and gloo is the torch.distributed backend with
``recv`` from any source, which the serving side needs.

Messages are a 4-integer header (``kind, round, a, b``) optionally followed by one flat
float tensor whose size both sides know. Every operation has the group's timeout; a peer that
died or stopped answering raises :class:`PeerError` naming both ranks instead of hanging.

Why not torch RPC or Horovod: Horovod has only collectives (every rank in every call); torch
RPC works but adds a TensorPipe agent with its own rendezvous and thread pool next to the
training group, for what is a fixed request/response of one vector. ``docs/async.md`` has the
measured cost of this transport.
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

# message kinds (header[0])
REQ, END, LEAVE, PUSH, ACQUIRE, REPLY = 1, 2, 3, 4, 5, 6
KIND_NAMES = {REQ: "REQ", END: "END", LEAVE: "LEAVE", PUSH: "PUSH", ACQUIRE: "ACQUIRE", REPLY: "REPLY"}


class PeerError(RuntimeError):
    """A peer of an asynchronous exchange failed, left the job or timed out."""


class P2PChannel:
    """A gloo process group over the world for one thread per process (see module docstring)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the asynchronous algorithms need torch.distributed (launcher=torch or local)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = float(timeout_s)
        self.group = dist.new_group(list(range(self.world_size)), timeout=timedelta(seconds=self.timeout_s),
                                    backend="gloo")
        self.bytes_sent = 0
        self.messages = 0
        self._count = threading.Lock()

    def _fail(self, what: str, peer: Optional[int], e: BaseException) -> PeerError:
        who = f"rank {peer}" if peer is not None else "any peer"
        return PeerError(f"rank {self.rank}: {what} with {who} failed ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); a peer died or stopped answering "
                         f"within {self.timeout_s:.0f} s")

    def _account(self, t: torch.Tensor) -> None:
        with self._count:
            self.bytes_sent += t.numel() * t.element_size()
            self.messages += 1

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().to("cpu").contiguous()
        try:
            dist.send(t, dst, group=self.group)
        except Exception as e:  # noqa: BLE001 - re-raised with both ranks named
            raise self._fail("send", dst, e) from e
        self._account(t)

    def recv(self, t: torch.Tensor, src: Optional[int]) -> int:
        """Receive into the CPU tensor ``t`` from ``src`` (None: any rank); returns the sender."""
        try:
            got = dist.recv(t, src, group=self.group)
        except Exception as e:  # noqa: BLE001
            raise self._fail("receive", src, e) from e
        return int(got if got is not None and got >= 0 else src)

    def send_header(self, dst: int, kind: int, rnd: int = 0, a: int = 0, b: int = 0) -> None:
        self.send(torch.tensor([kind, rnd, a, b], dtype=torch.int64), dst)

    def recv_header(self, src: Optional[int] = None) -> tuple[int, int, int, int, int]:
        """(sender, kind, round, a, b) of the next header from ``src`` (None: any rank)."""
        h = torch.zeros(4, dtype=torch.int64)
        sender = self.recv(h, src)
        kind, rnd, a, b = (int(v) for v in h.tolist())
        return sender, kind, rnd, a, b

    def stats(self) -> dict:
        with self._count:
            return {"p2p_bytes_sent": self.bytes_sent, "p2p_messages": self.messages}
