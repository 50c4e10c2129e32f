"""torch.distributed backend (gloo for CPU tensors, NCCL for CUDA tensors).

* ``allreduce_mean_``: fused flat buckets, one async ``all_reduce(SUM)`` per bucket on the
  group's ProcessGroup, then divided by the group size (gloo has no AVG op).
* ``new_group``: ``dist.new_group(ranks)``, which is collective over the world: every rank
  calls it with the same ranks in the same order (cached per rank tuple).
* ``exchange``: ``batch_isend_irecv`` with exactly the two partners involved
  (``collective_exchange = False``: other ranks need not call it).
* ``allgather_``: the sizes first, then one ``all_gather`` of tensors padded to the largest.
* ``host()``: on NCCL, a view of the world on a gloo group of its own for host tensors
  (created once, collectively, on first use; its traffic counts in the same ``stats``); on
  gloo the communicator itself.

The backend follows the worker's resolved device (``device_kind``, see ``device.py``), never
whether CUDA is merely visible: a ``device=cpu`` run on a GPU host uses gloo end to end.
``device`` declares a device explicitly (a test declares ``meta`` to check an algorithm's
collectives; the backend is then gloo).

Rendezvous (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` from the launcher): in a
process started by torchrun, torchrun's agent store; otherwise rank 0 serves the store from a
socket bound to ``MASTER_ADDR`` only (:mod:`.rendezvous`). gloo's and NCCL's sockets listen on the
interface of the rank's bind address (``bind_address``, else the route to ``MASTER_ADDR``).
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .base import Communicator, Group, nbytes
from .device import DeviceKind, torch_backend
from .fusion import make_buckets


def init_from_env(backend: str, timeout: timedelta, bind_address: Optional[str] = None) -> None:
    """Join the process group the launcher's environment describes (see module docstring)."""
    from . import rendezvous

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    rendezvous.use_interface(rendezvous.bind_address(bind_address, master))
    if rendezvous.uses_agent_store():
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rendezvous.tcp_store(rank, world, master, int(os.environ["MASTER_PORT"]), timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


class TorchDistCommunicator(Communicator):
    collective_exchange = False
    point_to_point = True

    def __init__(self, bucket_bytes: int = 4 << 20, device_kind: DeviceKind = "cpu", timeout_s: int = 600,
                 bind_address: Optional[str] = None, device: Optional[torch.device | str] = None) -> None:
        super().__init__()
        self.bucket_bytes = int(bucket_bytes)
        self.device = torch.device(device if device is not None else device_kind)
        self.backend = torch_backend("cuda" if self.device.type == "cuda" else "cpu")
        if not dist.is_initialized():
            init_from_env(self.backend, timedelta(seconds=timeout_s), bind_address)
        self._pg = None                      # the world's ProcessGroup (None: the default group)
        self._group_backend: Optional[str] = None
        self._groups: dict[tuple[int, ...], Any] = {}
        self._host: Optional[Communicator] = None
        self._liveness = None

    @classmethod
    def _view(cls, parent: "TorchDistCommunicator", pg, backend: str, device: torch.device) -> "TorchDistCommunicator":
        """The same ranks on ProcessGroup ``pg`` (its sub-groups on ``backend`` too), for ``device`` tensors."""
        view = cls.__new__(cls)
        Communicator.__init__(view)
        view.bucket_bytes, view.device, view.backend = parent.bucket_bytes, device, backend
        view._pg, view._group_backend, view._groups, view._host, view._liveness = pg, backend, {}, None, None
        view.stats = parent.stats   # one account of the worker's collective traffic
        return view

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank))

    def host(self) -> Communicator:
        if self.device.type == "cpu":
            return self
        if self._host is None:   # collective: every rank asks at the same point (algorithm construction)
            pg = dist.new_group(list(range(self.world_size)), backend="gloo")
            self._host = TorchDistCommunicator._view(self, pg, "gloo", torch.device("cpu"))
        return self._host

    def liveness(self, dead_after_s: float):
        """This process's heartbeats (:mod:`.liveness`), started on first use, signed with the run's
        secret its launcher handed out."""
        from .liveness import Liveness, store_client
        from .rendezvous import run_secret

        if self._liveness is None:
            self._liveness = Liveness(store_client(dead_after_s), self.rank, dead_after_s, secret=run_secret())
        return self._liveness

    def new_group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted(int(r) for r in ranks))
        if key == tuple(range(self.world_size)):
            return Group(key, self._pg)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), backend=self._group_backend)
        return Group(key, self._groups[key])

    def _handle(self, group: Optional[Group]):
        return self._pg if group is None or group.handle is None else group.handle

    def allreduce_mean_(self, tensors: Sequence[torch.Tensor], group: Optional[Group] = None) -> None:
        tensors = list(tensors)
        self.check_device("allreduce_mean_", tensors)
        if not tensors or (group is not None and group.size == 1):
            return  # nothing to average: no collective, no traffic
        size = self.world_size if group is None else group.size
        buckets = make_buckets(tensors, self.bucket_bytes)
        with self._timed(nbytes(tensors)):
            works = [dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=self._handle(group), async_op=True)
                     for b in buckets]
            for w in works:
                w.wait()
        for b in buckets:
            b.flat.div_(size)
            b.unpack_()

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        tensors = list(tensors)
        self.check_device("broadcast_", tensors)
        buckets = make_buckets(tensors, self.bucket_bytes)
        with self._timed(nbytes(tensors) if self.rank == root else 0):
            works = [dist.broadcast(b.flat, src=root, group=self._pg, async_op=True) for b in buckets]
            for w in works:
                w.wait()
        for b in buckets:
            b.unpack_()

    def exchange(self, tensors: Sequence[torch.Tensor], partner: Optional[int]) -> Optional[list[torch.Tensor]]:
        tensors = list(tensors)
        self.check_device("exchange", tensors)
        if partner is None:
            return None
        if not (0 <= partner < self.world_size) or partner == self.rank:
            raise ValueError(f"invalid exchange partner {partner} for rank {self.rank}")
        sends = [t.detach().contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, partner, group=self._pg) for t in sends] + \
              [dist.P2POp(dist.irecv, r, partner, group=self._pg) for r in recvs]
        with self._timed(nbytes(tensors)):
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return recvs

    def barrier(self) -> None:
        with self._timed(0):
            dist.barrier(group=self._pg)

    def allgather_(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.check_device("allgather_", [tensor])
        if tensor.dim() < 1:
            raise ValueError("allgather_ needs a tensor of at least one dimension")
        t = tensor.detach().contiguous()
        n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
        sizes = [torch.empty_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self._pg)
        counts = [int(s) for s in sizes]
        rest = tuple(t.shape[1:])
        padded = torch.zeros((max(counts),) + rest, dtype=t.dtype, device=t.device)
        padded[:counts[self.rank]] = t
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        with self._timed(padded.numel() * padded.element_size()):
            dist.all_gather(parts, padded, group=self._pg)
        return [p[:c] for p, c in zip(parts, counts)]

    def shutdown(self) -> None:
        if self._liveness is not None:
            self._liveness.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
