"""Single-process communicator: ``replicas`` identical workers, every collective the identity.

Used by the ``local`` launcher for one worker, as the reference "single-process SGD" in the
equivalence tests, and (``replicas`` > 1) as a world of identical workers: the mean of identical
tensors is the tensor, a partner's tensors in ``exchange`` are copies of this rank's, a broadcast
changes nothing. ``device`` declares where its tensors must be (``"meta"`` in the tests that check
that an algorithm's collectives stay on the communicator's device without running any kernel).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .base import Communicator, Group


class LocalCommunicator(Communicator):
    collective_exchange = False

    def __init__(self, replicas: int = 1, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if replicas < 1:
            raise ValueError(f"replicas={replicas}: need >= 1")
        self.replicas = int(replicas)
        self.device = torch.device(device)

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self.replicas

    def host(self) -> Communicator:
        return self if self.device.type == "cpu" else LocalCommunicator(self.replicas)

    def new_group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted(int(r) for r in ranks))
        if not key or key[0] < 0 or key[-1] >= self.replicas:
            raise ValueError(f"local communicator has ranks 0..{self.replicas - 1}, got group {list(ranks)}")
        return Group(key)

    def allreduce_mean_(self, tensors: Sequence[torch.Tensor], group: Optional[Group] = None) -> None:
        self.check_device("allreduce_mean_", tensors)
        with self._timed(0):
            pass

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        self.check_device("broadcast_", tensors)

    def exchange(self, tensors: Sequence[torch.Tensor], partner: Optional[int]) -> Optional[list[torch.Tensor]]:
        self.check_device("exchange", tensors)
        if partner is None:
            return None
        if not 0 <= partner < self.replicas or (self.replicas > 1 and partner == self.rank):
            raise ValueError(f"invalid exchange partner {partner} for rank 0 of {self.replicas}")
        return [t.detach().clone() for t in tensors]

    def barrier(self) -> None:
        pass

    def allgather_(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.check_device("allgather_", [tensor])
        return [tensor.detach().clone() for _ in range(self.replicas)]
