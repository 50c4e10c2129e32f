"""Consensus distance: how far the workers' models have drifted apart.

For M workers with parameter vectors x_1..x_M and their average x_bar,

    consensus distance = (1/M) * sum_i ||x_i - x_bar||^2

(Kong et al. 2021 call it Xi^2). It is 0 right after an exact average (AR-SGD, local SGD at
an averaging step) and grows between averagings; decentralized methods (SwarmSGD, D-PSGD)
and elastic averaging keep it small but non-zero. The training loop logs it at every
evaluation, together with the metrics of the *averaged* model (:func:`averaged_parameters`;
:func:`swapped` evaluates other tensors, e.g. EASGD's centre, the same way).

:func:`squared_distance` is a collective over the world: every rank calls it at the same
point and gets the same value as a one-element float64 tensor on the tensors' device (two
averaging all-reduces on the communicator's device: the mean vector, then the mean of the
squared distances); :func:`consensus_distance` is its value as a float.
:func:`consensus_distance_of` is the same formula on a list of vectors in one process, used by
tests and benchmarks.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from .comm.base import Communicator
from .comm.fusion import flatten


def squared_distance(tensors: Sequence[torch.Tensor], comm: Communicator) -> torch.Tensor:
    """Mean over workers of the squared distance of ``tensors`` to the world average (collective),
    computed where the tensors are (no host copy before the all-reduces)."""
    x = flatten(tensors, dtype=torch.float64, device=None if tensors else comm.staging_device())
    mean = x.clone()
    comm.allreduce_mean_([mean])
    d = ((x - mean) ** 2).sum().reshape(1)
    comm.allreduce_mean_([d])
    return d


def consensus_distance(tensors: Sequence[torch.Tensor], comm: Communicator) -> float:
    """:func:`squared_distance` as a float."""
    return float(squared_distance(tensors, comm).item())


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
