"""Single-process communicator (world size 1): every collective is the identity.

Used by the ``local`` launcher for quick experiments and as the reference "single-process
SGD" in the equivalence tests. ``exchange`` with partner 0 (itself) returns copies.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .base import Communicator, Group


class LocalCommunicator(Communicator):
    collective_exchange = False

    def __init__(self) -> None:
        super().__init__()

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def new_group(self, ranks: Sequence[int]) -> Group:
        if tuple(ranks) != (0,):
            raise ValueError(f"local communicator has only rank 0, got group {list(ranks)}")
        return Group((0,))

    def allreduce_mean_(self, tensors: Sequence[torch.Tensor], group: Optional[Group] = None) -> None:
        with self._timed(0):
            pass

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        pass

    def exchange(self, tensors: Sequence[torch.Tensor], partner: Optional[int]) -> Optional[list[torch.Tensor]]:
        if partner is None:
            return None
        if partner != 0:
            raise ValueError(f"local communicator has only rank 0, got partner {partner}")
        return [t.detach().clone() for t in tensors]

    def barrier(self) -> None:
        pass

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]
