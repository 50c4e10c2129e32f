"""A study at a tiny size (``tiny: true`` in the study file, or ``--set tiny=true``): the same cells'
configs on little data for a few steps, to check that a study runs end to end before its real run.

What shrinks: one seed; two cells (the first two variants with each grid factor's first value, or,
without variants or with both, the first two values of the first grid factor, the first value of the
others and the first variant; shipped studies list their baseline first, so the baseline selection
keeps matching); training stops after
``TRAIN["max_steps"]`` steps and validates every ``TRAIN["eval_every"]``; image studies ingest the first
``IMAGES["ingest.limit"]`` records (Fashion-MNIST: its 10,000 test images, then 10,000 training images);
HEP studies generate ``HEP["events_per_class"]`` events per class and train with a batch of
``HEP["train.batch_size"]`` per worker (the shards of many workers are small). A kept variant's own value of one of
these keys (a step budget per batch) gives way to the tiny one. What stays: the workers,
layouts, algorithms, optimizers and schedules of every kept cell. A tiny run is never recorded
(``records`` is dropped): its numbers are not results. A tiny run whose batches are not
augmented runs its workers as ranks of one process (``launcher: inprocess``, :func:`in_one_process`:
a synchronous algorithm gives the local launcher's run without starting a process per worker; an
asynchronous or time-budgeted one runs under the simulated clock); augmented runs keep their launcher.
"""
from __future__ import annotations

from typing import Any

TRAIN: dict[str, Any] = {"train.max_steps": 4, "train.eval_every": 2, "train.progress": False,
                         "train.checkpoint_every": 0}
IMAGES: dict[str, Any] = {"ingest.limit": 20000}
HEP: dict[str, Any] = {"events_per_class": 300, "train.batch_size": 8}


def in_one_process(cfg):
    """The run config ``cfg`` (a workflow's) with ``train.launcher: inprocess`` where it runs there
    (every algorithm: the asynchronous ones and time-budgeted rounds under the simulated clock; not
    augmented batches); ``cfg`` itself otherwise."""
    t = cfg.train
    if t.augment != "none":
        return cfg
    return cfg.model_copy(update={"train": t.model_copy(update={"launcher": "inprocess"})})


def shrink(spec):
    """The tiny version of a StudyConfig (see the module docstring); ``spec`` itself is unchanged."""
    f = spec.factors
    keys = list(f.grid)
    first_two = bool(keys) and len(f.grid[keys[0]]) > 1
    grid = {k: v[:2] if (i == 0 and first_two) else v[:1] for i, (k, v) in enumerate(f.grid.items())}
    small = {**TRAIN, **(IMAGES if spec.workflow == "images" else HEP)}
    # a variant's own step budget or batch would undo the tiny size: the tiny values win
    kept = [v.model_copy(update={"set": {k: x for k, x in v.set.items() if k not in small}})
            for v in (f.variants[:1] if first_two else f.variants[:2])]
    factors = f.model_copy(update={"grid": grid, "variants": kept})
    fixed = {**spec.fixed, **small}
    return spec.model_copy(update={"factors": factors, "fixed": fixed, "seeds": spec.seed_list()[:1], "tiny": False,
                                 "records": None, "parallel_runs": 1})   # two runs of seconds: no pool to start
