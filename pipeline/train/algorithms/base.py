"""Base classes of every training algorithm, in the spirit of PyTorch's model averagers.

An algorithm wraps a model's parameters, a base torch optimizer and a Communicator, and
replaces ``optimizer.step()`` in the training loop::

    loss.backward()
    algo.step()          # before_step() -> apply_step() -> after_step(); step_count += 1

That is the ONE hook protocol of every algorithm: ``apply_step`` is the base optimizer's step
unless the algorithm applies the gradient itself (the asynchronous algorithms do it under
their model lock and fold their exchange into it; SlowMo applies its base algorithm's step).

It knows nothing about Spark, Horovod or torch.distributed; it talks only to the
communication interface (``pipeline.train.comm.base.Communicator``). Composition
(e.g. SlowMo around local SGD) is done by wrapping one algorithm in another.

Life cycle hooks, called by the worker (``pipeline.train.worker.Worker``):

* ``on_start(worker)`` -- once, after rank 0's initial weights were broadcast and before any
  step or checkpoint restore: capture reference points (SlowMo's x0), start a background
  communication thread (an algorithm with ``owns_communication = True``).
* ``on_finish(worker)`` -- once, after the last step, before the final model is formed and
  evaluated: quiesce background threads, drain pending exchanges.
* ``close()`` -- always, last (also when the run fails): join threads, free resources. Must
  not block on peers.
* ``evaluation_tensors()`` -- what to evaluate: ``None`` (default) means the world average of
  the parameters when the workers are apart; an algorithm may return its own tensors
  (EASGD's centre), shaped like ``averager.tensors()``, identical on every rank. The final
  model is formed the same way.
* ``extra_evaluations()`` -- ``{name: tensors}`` evaluated on the test split in addition at
  the end (same shape contract); reported as ``<name>_test_accuracy`` in the summary and
  ``<name>_accuracy`` in the test record.
* ``eval_metrics()`` -- called on EVERY rank at every evaluation (may be collective); the
  dict joins the evaluation record.
* ``summary_stats()`` -- a small dict merged into this rank's entry of the summary.

:class:`RoundAlgorithm` is the typed round protocol of algorithms that communicate in rounds
(SwarmSGD, time-budgeted local SGD, SlowMo around them). When ``variable_steps`` is True,
workers take different numbers of local steps per round and the training run must be driven
by rounds (``pipeline.train.drivers.run_rounds``), not by a shared step count.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Optional

import torch

from ..comm.base import Communicator


class Algorithm:
    name = "base"
    #: workers take different step counts (the run is driven by rounds; see RoundAlgorithm)
    variable_steps: bool = False
    #: the algorithm exchanges on its own (a background thread started in on_start); the
    #: worker's own collectives (evaluation, checkpoints) happen only where the schedule
    #: meets every rank: round boundaries of a RoundAlgorithm, at which the algorithm has
    #: quiesced its thread
    owns_communication: bool = False

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 comm: Communicator) -> None:
        self.params = [p for p in params]
        self.optimizer = optimizer
        self.comm = comm
        self.step_count = 0  # number of completed step() calls

    # life cycle
    def on_start(self, worker: Any = None) -> None:
        """Once, after the initial broadcast, before the first step (see module docstring)."""

    def on_finish(self, worker: Any = None) -> None:
        """Once, after the last step (see module docstring)."""

    def close(self) -> None:
        """Always, last, also after a failure (see module docstring)."""

    def eval_metrics(self) -> dict[str, Any]:
        """Extra fields of every evaluation record (called on every rank; may be collective)."""
        return {}

    def summary_stats(self) -> dict[str, Any]:
        """Extra fields of this rank's summary entry."""
        return {}

    def extra_evaluations(self) -> dict[str, list[torch.Tensor]]:
        """Named tensor sets evaluated on the test split at the end, in addition to the model."""
        return {}

    # hooks
    def before_step(self) -> None:
        """After backward, before the base optimizer step (e.g. average gradients)."""

    def apply_step(self) -> None:
        """Apply the gradients (default: the base optimizer's step)."""
        self.optimizer.step()

    def after_step(self) -> None:
        """After the gradients were applied (e.g. average parameters every H steps)."""

    def step(self) -> None:
        """The hook protocol (see module docstring); ``step_count`` counts completed steps, so a
        hook sees the number of steps before this one."""
        self.before_step()
        self.apply_step()
        self.after_step()
        self.step_count += 1

    def in_sync(self) -> bool:
        """True when, after the last step, every worker holds the same parameters."""
        return False

    def evaluation_tensors(self) -> Optional[list[torch.Tensor]]:
        """Tensors to evaluate instead of the world average (None: the world average)."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state.get("step_count", 0))


class RoundAlgorithm(Algorithm, ABC):
    """An algorithm that communicates at the end of rounds of local steps.

    * ``rounds_done`` -- completed rounds;
    * ``round_finished`` -- the last ``step()`` ended a round (every worker is then at the same
      round boundary: evaluation happens there);
    * ``nominal_steps_per_round`` -- H, converts the run's step budget into rounds;
    * ``variable_steps`` -- workers may take different step counts per round;
    * ``reset_clock()`` -- restart the round's time budget after a pause (evaluation).

    Subclasses keep the three attributes up to date (plain attributes or properties).
    """

    rounds_done: int
    round_finished: bool
    nominal_steps_per_round: int

    @abstractmethod
    def reset_clock(self) -> None: ...


def is_round_driven(algo: Algorithm) -> bool:
    """The run must be driven by rounds: a round algorithm whose workers take different step counts."""
    return isinstance(algo, RoundAlgorithm) and bool(algo.variable_steps)
