"""Consensus distance: how far the workers' models have drifted apart.

For M workers with parameter vectors x_1..x_M and their average x_bar,

    consensus distance = (1/M) * sum_i ||x_i - x_bar||^2

(Kong et al. 2021 call it Xi^2). It is 0 right after an exact average (AR-SGD, local SGD at
an averaging step) and grows between averagings; decentralized methods (SwarmSGD, D-PSGD)
and elastic averaging keep it small but non-zero. The training loop logs it at every
evaluation, together with the metrics of the *averaged* model (:func:`averaged_parameters`;
:func:`swapped` evaluates other tensors, e.g. EASGD's centre, the same way).

:func:`consensus_distance` is a collective over the world: every rank calls it at the same
point and gets the same value (two averaging all-reduces: the mean vector, then the mean
of the squared distances, computed in float64). :func:`consensus_distance_of` is the same
formula on a list of vectors in one process, used by tests and benchmarks.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from .comm.base import Communicator


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)


def consensus_distance(tensors: Sequence[torch.Tensor], comm: Communicator) -> float:
    """Mean over workers of the squared distance of ``tensors`` to the world average (collective)."""
    x = _flat(tensors).cpu()
    mean = x.clone()
    comm.allreduce_mean_([mean])
    d = torch.tensor([float(((x - mean) ** 2).sum())], dtype=torch.float64)
    comm.allreduce_mean_([d])
    return float(d.item())


def consensus_distance_of(vectors: Sequence[np.ndarray | torch.Tensor]) -> float:
    """The same quantity for vectors held in one process."""
    xs = np.stack([np.asarray(v, dtype=np.float64).reshape(-1) for v in vectors])
    return float(((xs - xs.mean(axis=0)) ** 2).sum(axis=1).mean())


@contextmanager
def swapped(tensors: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Temporarily copy ``values`` into ``tensors`` (pairwise, as far as both go), restoring them after."""
    pairs = list(zip(tensors, values))
    saved = [t.detach().clone() for t, _ in pairs]
    with torch.no_grad():
        for t, v in pairs:
            t.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for (t, _), s in zip(pairs, saved):
                t.copy_(s)


@contextmanager
def averaged_parameters(tensors: Sequence[torch.Tensor], comm: Communicator) -> Iterator[None]:
    """Temporarily replace ``tensors`` by their world average (collective), restoring them after.

    Used to evaluate the averaged model of a decentralized run without disturbing training.
    """
    avg = [t.detach().clone() for t in tensors]
    comm.allreduce_mean_(avg)
    with swapped(tensors, avg):
        yield
