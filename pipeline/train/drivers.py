"""Drivers: what takes a :class:`~.worker.Worker` through a run, step by step or round by round.

:func:`driver_for` picks the driver the algorithm needs:

* :func:`run_steps` (step-driven, every algorithm whose workers take the same steps):
  E_overlap = ``plan.overlap_epochs`` passes over the worker's OWN shard, each of
  ``plan.steps_per_epoch`` steps (= min over workers of rows // b, so every rank takes the
  same number of steps), ``plan.total_steps`` in all; the reader is seeded per (worker,
  epoch); validation every ``plan.eval_every`` steps and at the end; checkpoints every
  ``checkpoint_every`` steps; ``resume`` continues mid-epoch from the newest checkpoint.
* :func:`run_rounds` (round-driven: a :class:`~.algorithms.base.RoundAlgorithm` with
  ``variable_steps``, whose workers take different step counts per round):

  - the run lasts ``ceil(total_steps / H)`` rounds, H = ``nominal_steps_per_round``: the same
    sample budget as a fixed-H run when workers keep pace; a slow worker processes fewer
    samples, a fast one more;
  - each worker cycles through its own shard, epoch after epoch, until the last round ends;
  - the learning rate follows the ROUND clock (step ``rounds_done * H``, the same for every
    worker in a round);
  - validation at round boundaries, every ``ceil(eval_every / H)`` rounds, after which the
    round clock restarts;
  - checkpoints at the first round boundary at or after each multiple of ``checkpoint_every``
    nominal steps (``rounds_done * H``, the checkpoint's step label, the same on every rank);
    a resume continues from such a checkpoint with a warning: step counts that depend on
    the wall clock make the continuation differ from an uninterrupted run.

  Records carry ``rounds``; ``step`` is rank 0's local step count; the summary's
  ``samples_processed`` is the true sum over workers.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

from .algorithms.base import RoundAlgorithm, is_round_driven
from .worker import Worker

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- step-driven
def run_steps(w: Worker) -> dict:
    """Drive ``w`` by a step count shared by every worker (see module docstring)."""
    w.start(resume=True)
    spe, total = w.plan.steps_per_epoch, w.plan.total_steps
    last_ckpt: Optional[str] = None
    epoch, offset = divmod(w.step, spe)
    while w.step < total:
        todo = min(spe - offset, total - w.step)
        done, ckpt = _step_epoch(w, epoch, offset, todo)
        last_ckpt = ckpt or last_ckpt
        if done != todo:
            raise RuntimeError(f"worker {w.rank}: shard {w.shard.path} gave {done} batches in epoch {epoch}, "
                               f"expected {todo}")
        epoch, offset = epoch + 1, 0
    # the loop never validates at the last step (it may be a multiple of eval_every): finish does,
    # whenever a step was taken since the last record, so every run is scored at its final step
    pending = w.meter.interval["n"] > 0
    return w.finish(log_val=pending, last_checkpoint=last_ckpt)


def _step_epoch(w: Worker, epoch: int, offset: int, todo: int) -> tuple[int, Optional[str]]:
    """One (possibly partial) pass over the shard; returns (steps taken, last checkpoint path)."""
    total, every, ck_every = w.plan.total_steps, w.plan.eval_every, w.cfg.checkpoint_every
    done, last_ckpt = 0, None
    bar = w.progress(w.plan.steps_per_epoch, offset, f"epoch {epoch + 1}/{w.plan.overlap_epochs}")
    with w.batches(epoch, skip=offset, limit=offset + todo) as batches:
        for inputs, y in batches:
            w.train_step(inputs, y, lr_step=w.step)
            done += 1
            bar.update(1)
            if w.step % every == 0 and w.step < total:
                w.log_eval()
            if ck_every and w.step % ck_every == 0 and w.step < total:
                last_ckpt = w.checkpoint() or last_ckpt
    bar.close()
    return done, last_ckpt


# ---------------------------------------------------------------------------- round-driven
def run_rounds(w: Worker) -> dict:
    """Drive ``w`` by rounds of its round-driven algorithm (see module docstring)."""
    algo = w.algo
    if not isinstance(algo, RoundAlgorithm):
        raise TypeError(f"run_rounds needs a RoundAlgorithm, got {type(algo).__name__}")
    H = max(1, int(algo.nominal_steps_per_round))
    total_rounds = max(1, math.ceil(w.plan.total_steps / H))
    if w.plan.resume_from and w.rank == 0:
        log.warning("resuming %s from %s: the continuation is not bit-identical to an uninterrupted run "
                    "(local step counts depend on the wall clock)", w.cfg.algorithm.name, w.plan.resume_from)
    w.start(resume=True)
    bar = w.progress(total_rounds, algo.rounds_done, "rounds")
    algo.reset_clock()
    last_eval = algo.rounds_done
    epoch = (algo.rounds_done * H) // w.plan.steps_per_epoch
    last_ckpt: Optional[str] = None
    while algo.rounds_done < total_rounds:
        last_eval, last_ckpt = _round_epoch(w, algo, epoch, total_rounds, bar, last_eval, last_ckpt)
        epoch += 1
    bar.close()
    return w.finish(log_val=algo.rounds_done != last_eval, last_checkpoint=last_ckpt,
                    ckpt_step=algo.rounds_done * H, rounds=algo.rounds_done)


def _round_epoch(w: Worker, algo: RoundAlgorithm, epoch: int, total_rounds: int, bar, last_eval: int,
                 last_ckpt: Optional[str]) -> tuple[int, Optional[str]]:
    """One pass over the shard, stopping when the last round ends; returns the last evaluated
    round and the last checkpoint path."""
    H = max(1, int(algo.nominal_steps_per_round))
    eval_rounds = max(1, math.ceil(w.plan.eval_every / H))
    ck = w.cfg.checkpoint_every
    with w.batches(epoch, limit=w.plan.steps_per_epoch) as batches:
        for inputs, y in batches:
            w.train_step(inputs, y, lr_step=algo.rounds_done * H)
            if not algo.round_finished:
                continue
            r = algo.rounds_done
            bar.update(1)
            if r >= total_rounds:
                break
            paused = False
            if r % eval_rounds == 0:
                w.log_eval(rounds=r)
                last_eval, paused = r, True
            if ck and (r * H) // ck > ((r - 1) * H) // ck:
                last_ckpt = w.checkpoint(step=r * H) or last_ckpt
                paused = True
            if paused:  # the pause does not count against the round's time budget
                algo.reset_clock()
    return last_eval, last_ckpt


# ---------------------------------------------------------------------------- which driver
def driver_for(algo) -> Callable[[Worker], dict]:
    """``run_rounds`` for a round-driven algorithm, else ``run_steps``."""
    return run_rounds if is_round_driven(algo) else run_steps
