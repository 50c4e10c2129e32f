"""One worker's training run: build, step, evaluate, checkpoint, finish.

A :class:`Worker` is the state of one worker process (a Horovod-on-Spark task, a
TorchDistributor/torchrun process or a local process) and the verbs a schedule drives it with
(``pipeline.train.drivers``: step-driven ``run_steps``, round-driven ``run_rounds``)::

    w = Worker(cfg, comm, plan, out_dir, ckpt_dir, device)   # build (rank 0's weights broadcast)
    w.start()                                                # algo.on_start, resume, metrics writer
    with w.batches(epoch, skip, limit) as it:                # this worker's shard, seeded per epoch
        for inputs, y in it:
            w.train_step(inputs, y, lr_step=w.step)          # lr, forward/backward, algo.step()
    w.log_eval()                                             # validation record (collective)
    w.checkpoint()                                           # every rank's state, file by rank 0
    summary = w.finish(log_val=True)                         # algo.on_finish, final model, test

Building: seeds everything from ``cfg.seed``, builds the model, broadcasts rank 0's initial
state, then the base optimizer, the averaging policy (``ModelAverager``) and the algorithm from
the registry (its ``BuildContext`` carries the run seed).

Evaluation scores the consensus model: the algorithm's own tensors when it names them
(``Algorithm.evaluation_tensors``, e.g. EASGD's centre), else the world average of the
parameters when the workers are apart (``consensus.averaged_parameters``), with BatchNorm
statistics averaged under ``policy.batchnorm=average``. Each rank scores a 1/M slice of the
split and the predictions are gathered. The consensus distance is logged with it; the per-class AUC
of the gathered split is computed once, each rank taking every M-th class (``metrics.summarize``).

Communication used only for bookkeeping (initial broadcast, evaluation, checkpoint
gathering) is excluded from the communication statistics.

Debug hooks (``cfg.debug``): a parameter digest after every step; a simulated crash after a
given step (``restart.inject_fault``: every rank or one rank; an exception or SIGKILL).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .augment import crop_flip
from .digest import param_digest
from .optimizers import make_optimizer
from .progress import emit

log = logging.getLogger(__name__)


#: held while a worker seeds the global generators and draws its model's initial weights from them
_GLOBAL_RNG = threading.Lock()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)


class Meter:
    """Training time and the counters an evaluation record reports rates over.

    ``interval`` restarts at every record; ``whole_run`` spans the run (the final test record).
    """

    def __init__(self, comm, step: int) -> None:
        from .metrics import wire_bytes_written

        self.comm = comm
        self.t_start = time.perf_counter()
        self.train_s = 0.0
        self.interval = self._mark(step, 0.0)
        self.whole_run = dict(self.interval)
        self.wire0 = wire_bytes_written()
        self.bytes0 = comm.stats.bytes_sent

    def _mark(self, step: int, t: float) -> dict:
        return {"t": t, "comm": self.comm.stats.seconds, "step": step, "loss": 0.0, "n": 0}

    def add_step(self, seconds: float, loss: float) -> None:
        self.train_s += seconds
        for mk in (self.interval, self.whole_run):
            mk["loss"] += loss
            mk["n"] += 1

    def wall(self) -> float:
        return time.perf_counter() - self.t_start

    def record(self, split: str, res: dict, step: int, batch: int, world: int, elapsed0: float,
               epoch_steps: int, whole_run: bool = False) -> dict:
        from .metrics import wire_bytes_written

        comm, mark = self.comm, (self.whole_run if whole_run else self.interval)
        steps = step - mark["step"]
        dt = max(self.train_s - mark["t"], 1e-9)
        wire = wire_bytes_written()
        sent = comm.stats.bytes_sent - self.bytes0
        rec = {"kind": "eval", "split": split, "step": step, "epoch": round(step / epoch_steps, 4),
               "wall_s": round(elapsed0 + self.train_s, 3), "loss": res["loss"], "accuracy": res["accuracy"],
               "auc": res["auc"], "n_eval": res["n"],
               "train_loss": (mark["loss"] / mark["n"]) if mark["n"] else None,
               "samples_per_s": (steps * batch * world / dt) if steps else None,
               "comm_fraction": ((comm.stats.seconds - mark["comm"]) / dt) if steps else None,
               "bytes_sent": sent, "bytes_sent_per_step": sent / max(step, 1),
               "wire_bytes_written": (wire - self.wire0) if wire is not None and self.wire0 is not None else None,
               "consensus_distance": res.get("consensus_distance")}
        from .comm.simcore import current

        sim = current()
        if sim is not None:     # under the simulated clock: the virtual time of the record (time to a target)
            rec["virtual_s"] = round(sim.now, 6)
        self.interval = self._mark(step, self.train_s)
        return rec


class Worker:
    """State and verbs of one worker's training run (see module docstring)."""

    def __init__(self, cfg, comm, plan, out_dir: str, ckpt_dir: str, device: torch.device,
                 watchdog=None) -> None:
        """``plan``: a :class:`~.plan.TrainingPlan` or its dict (validated here); ``watchdog``: a
        :class:`~.watchdog.Watchdog` told of each completed step, evaluation and checkpoint."""
        from ..data.shard_reader import load_scaling
        from ..errors import BadInputError
        from ..shards.manifest import load_manifest
        from .algorithms import BuildContext, build_algorithm
        from .algorithms.averaging import ModelAverager, bn_buffers
        from .models import build_model
        from .stragglers import StragglerSimulator

        from .plan import TrainingPlan

        self.plan = plan if isinstance(plan, TrainingPlan) else TrainingPlan.model_validate(plan)
        plan = self.plan
        self.cfg, self.comm, self.device = cfg, comm, device
        self.beat = watchdog.beat if watchdog is not None else (lambda: None)
        self.out_dir, self.ckpt_dir = out_dir, ckpt_dir
        self.rank, self.world = comm.rank, comm.world_size
        self.manifest = load_manifest(cfg.manifest)
        if self.world != self.manifest.num_workers:
            raise BadInputError(f"{cfg.manifest}: {self.manifest.num_workers} worker shards but {self.world} workers")
        self.shard = self.manifest.workers[self.rank]
        self.scaling = load_scaling(plan.scaling)
        with _GLOBAL_RNG:    # ranks on threads of one process (inprocess) share the global generators
            seed_everything(cfg.seed)
            self.model = build_model(cfg.model, plan.num_classes, plan.shape, init=cfg.init).to(device)
        with comm.stats_paused():
            comm.broadcast_(list(self.model.state_dict().values()), root=0)
        self.optimizer = make_optimizer(cfg, self.model.parameters(), switch_step=plan.warmup_steps)
        self.averager = ModelAverager(self.model, self.optimizer, comm, cfg.policy.batchnorm, cfg.policy.momentum)
        ctx = BuildContext(self.model, self.optimizer, comm, self.averager,
                           groups=[w.group for w in self.manifest.workers], seed=cfg.seed)
        self.algo = build_algorithm(cfg.algorithm.name, cfg.algorithm.params, ctx)
        self.bn = bn_buffers(self.model)
        self.stragglers = StragglerSimulator(cfg.stragglers, self.rank)
        self.step = 0
        self.elapsed0 = 0.0
        self.history: list[dict] = []
        self.digests: list[str] = []
        self.writer = None
        self.meter: Optional[Meter] = None

    # ------------------------------------------------------------------ life cycle
    def start(self, resume: bool = True) -> None:
        """``algo.on_start``, then resume from the newest checkpoint (when asked), then the metrics writer."""
        from .metrics import MetricsWriter

        self.algo.on_start(self)
        if resume:
            self._resume()
        self.writer = MetricsWriter(self.out_dir, self.history, self.cfg.tensorboard) if self.rank == 0 else None
        self.meter = Meter(self.comm, self.step)
        self.beat()

    def _resume(self) -> None:
        """Restore this rank from ``plan.resume_from`` (the driver picked the newest complete checkpoint)."""
        from . import checkpoint

        path = self.plan.resume_from
        if not path:
            return
        meta = checkpoint.restore(path, self.rank, self.model, self.optimizer, self.algo, self.device)
        self.step, self.elapsed0, self.history = int(meta["step"]), float(meta["elapsed_s"]), list(meta["metrics"])
        if self.rank == 0:
            log.info("resumed from %s at step %d", path, self.step)

    # ------------------------------------------------------------------ data and steps
    @contextmanager
    def batches(self, epoch: int, skip: int = 0, limit: Optional[int] = None) -> Iterator[Iterator]:
        """This worker's shard for ``epoch`` (seeded per worker and epoch): batches ``skip`` .. ``limit``."""
        from ..data.shard_reader import ShardReader, epoch_seed

        cfg, ld = self.cfg, self.cfg.loader
        seed = epoch_seed(cfg.seed, self.shard.seed, epoch)
        budget = None if ld.memory_budget_mb is None else int(ld.memory_budget_mb * (1 << 20))
        with ShardReader(self.shard.path, self.plan.batch_size, self.plan.features, seed=seed,
                         shuffle_buffer=cfg.shuffle_buffer, scaling=self.scaling, device=self.device, mode=ld.mode,
                         memory_budget=budget, decode_threads=ld.decode_threads, prefetch=ld.prefetch,
                         engine=ld.engine, progress=self.beat) as reader:
            yield reader.batches(skip_batches=skip, limit_batches=limit)

    def progress(self, total: int, initial: int, desc: str):
        """Rank 0's progress over ``total`` steps, shown by the driver (``progress``)."""
        from .progress import bar

        return bar(total, initial, desc, enabled=self.cfg.progress and self.rank == 0)

    def train_step(self, inputs, y, lr_step: int) -> float:
        """One step: the learning rate of schedule step ``lr_step``, forward/backward (inside the
        straggler simulator), ``algo.step()``; then the debug hooks. Returns the loss."""
        from .lr_schedule import lr_at, set_lr

        cfg, plan = self.cfg, self.plan
        t0 = time.perf_counter()
        set_lr(self.optimizer, lr_at(lr_step, cfg.lr, plan.lr_factor, plan.warmup_steps, plan.decay_steps,
                                     cfg.lr_decay_factor, cfg.warmup_lr if cfg.warmup_optimizer == "sgd" else None))
        if cfg.augment != "none" and plan.features == "image":
            inputs = (crop_flip(inputs[0]),) + tuple(inputs[1:])
        self.algo.zero_grad()
        with self.stragglers.compute():
            loss = F.cross_entropy(self.model(*inputs), y)
            loss.backward()
        self.algo.step()
        self.step += 1
        value = float(loss.detach())
        self.meter.add_step(time.perf_counter() - t0, value)
        self.beat()
        self._debug_hooks()
        return value

    def _debug_hooks(self) -> None:
        from .restart import inject_fault

        if self.cfg.debug.record_param_digests:
            self.digests.append(param_digest(self.model.parameters()))
        inject_fault(self.cfg.debug, self.rank, self.step)

    # ------------------------------------------------------------------ evaluation
    @contextmanager
    def evaluation_weights(self) -> Iterator[None]:
        """Inside the block the model holds the consensus model (see module docstring); collective."""
        from .consensus import averaged_parameters, swapped

        own = self.algo.evaluation_tensors()
        if own is not None:
            with swapped(self.averager.tensors(), own):
                yield
            return
        tensors = [] if self.algo.in_sync() else [p.data for p in self.model.parameters()]
        if self.cfg.policy.batchnorm == "average":
            tensors += self.bn
        with averaged_parameters(tensors, self.comm):
            yield

    def evaluate(self, path: str, weights: Optional[list] = None) -> dict:
        """Loss, accuracy, AUC of the consensus model (or of ``weights``, shaped like
        ``averager.tensors()``) on the split at ``path``, and the consensus distance."""
        from .consensus import consensus_distance, swapped
        from .metrics import summarize

        with self.comm.stats_paused():
            params = [p.data for p in self.model.parameters()]
            spread = 0.0 if self.algo.in_sync() else consensus_distance(params, self.comm)
            if weights is None:
                with self.evaluation_weights():
                    probs, labels, loss_sum = self._score(path)
            else:
                with swapped(self.averager.tensors(), weights):
                    probs, labels, loss_sum = self._score(path)
            dev = self.comm.staging_device()   # every rank's slice, gathered as tensors on the comm's device
            probs = self.comm.allgather_(torch.from_numpy(probs).to(dev))
            labels = self.comm.allgather_(torch.from_numpy(labels).to(dev))
            losses = self.comm.allgather_(torch.tensor([loss_sum], dtype=torch.float64, device=dev))
            res = summarize(np.concatenate([p.cpu().numpy() for p in probs]),
                            np.concatenate([y.cpu().numpy() for y in labels]),
                            float(sum(float(v) for v in losses)), self.comm)
        return {**res, "consensus_distance": spread}

    def _score(self, path: str) -> tuple:
        from ..data.shard_reader import read_all

        k = self.plan.num_classes
        probs, labels, loss_sum = [], [], 0.0
        self.model.eval()
        with torch.no_grad():
            for inputs, y in read_all(path, self.plan.features, self.scaling, 512, self.rank, self.world):
                out = self.model(*(t.to(self.device) for t in inputs))
                loss_sum += float(F.cross_entropy(out, y.to(self.device), reduction="sum"))
                probs.append(torch.softmax(out.float(), 1).cpu().numpy())
                labels.append(y.numpy())
                self.beat()
        self.model.train()
        return (np.concatenate(probs) if probs else np.zeros((0, k), np.float32),
                np.concatenate(labels) if labels else np.zeros(0, np.int64), loss_sum)

    def eval_path(self) -> str:
        ev = self.plan.eval
        return ev[self.cfg.eval_split] if self.cfg.eval_split in ev else ev["test"]

    def record(self, split: str, res: dict, whole_run: bool = False) -> dict:
        return self.meter.record(split, res, self.step, self.plan.batch_size, self.world, self.elapsed0,
                                 self.plan.epoch_steps, whole_run)

    def log_eval(self, **extra) -> dict:
        """Evaluate the validation split, write the record (rank 0); ``extra`` fields join the record."""
        split = self.cfg.eval_split
        rec = {**self.record(split, self.evaluate(self.eval_path())), **self.algo.eval_metrics(), **extra}
        if self.rank == 0:
            self.writer.write(rec)
            where = f"round {extra['rounds']} " if "rounds" in extra else ""
            emit(f"[train] {where}step {rec['step']} epoch {rec['epoch']:.2f} {split} loss {rec['loss']:.4f} "
                 f"acc {rec['accuracy']:.4f}")
        return rec

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, step: Optional[int] = None) -> Optional[str]:
        """Every rank writes its own state (collective); returns the checkpoint path on rank 0.
        ``step`` labels the checkpoint (default: this worker's step count; round-driven runs pass
        the nominal step ``rounds_done * H``, the same on every rank)."""
        from . import checkpoint

        meta = {"elapsed_s": self.elapsed0 + self.meter.wall(),
                "fingerprint": checkpoint.fingerprint(self.cfg, self.world),
                "metrics": list(self.writer.history) if self.writer else []}
        with self.comm.stats_paused():
            path = checkpoint.write(self.comm, self.ckpt_dir, self.step if step is None else step, self.model,
                                    self.optimizer, self.algo, meta, keep=self.cfg.keep_checkpoints)
        self.beat()
        return path

    # ------------------------------------------------------------------ the end
    def final_model(self) -> None:
        """Make the workers hold ONE model: the algorithm's own tensors, or the world average."""
        own = self.algo.evaluation_tensors()
        if own is not None:
            with torch.no_grad():
                for t, v in zip(self.averager.tensors(), own):
                    t.copy_(v)
        elif not self.algo.in_sync():
            self.averager.average_()

    def finish(self, log_val: bool, last_checkpoint: Optional[str] = None, ckpt_step: Optional[int] = None,
               **extra) -> dict:
        """``algo.on_finish``, the final model, [a last validation record], the test record (with the
        algorithm's extra evaluations), model.pt and the final checkpoint; returns this rank's
        summary (every rank's details gathered)."""
        self.algo.on_finish(self)
        self.final_model()
        train_wall = self.meter.wall()
        if log_val:
            self.log_eval(**extra)
        test = self.evaluate(self.plan.eval["test"])
        more = {f"{name}_test_accuracy": self.evaluate(self.plan.eval["test"], ts)["accuracy"]
                for name, ts in self.algo.extra_evaluations().items()}
        rec = {**self.record("test", test, whole_run=True), **self.algo.eval_metrics(), **extra,
               **{k.replace("_test", ""): v for k, v in more.items()}}
        if self.rank == 0:
            self.writer.write(rec)
            self.writer.close()
            from .checkpoint import save_torch  # a full disk: an OSError naming model.pt

            save_torch(f"{self.out_dir}/model.pt", {"model": self.model.state_dict(), "model_name": self.cfg.model,
                                                    "num_classes": self.plan.num_classes,
                                                    "shape": self.plan.shape, "step": self.step})
        last_checkpoint = self.checkpoint(ckpt_step) or last_checkpoint
        mine = {"rank": self.rank, "steps": self.step, "samples_processed": self.step * self.plan.batch_size,
                "final_digest": param_digest(self.model.parameters()), "digests": self.digests,
                "comm": self.comm.stats.snapshot(), "train_seconds": self.meter.train_s,
                **self.stragglers.stats(), **self.algo.summary_stats(), **extra}
        with self.comm.stats_paused():
            ranks = self.comm.allgather_object(mine)
        return {"rank": self.rank, "world": self.world, "steps": self.step, "test_accuracy": test["accuracy"],
                "test_loss": test["loss"], "auc": test["auc"], "train_seconds": self.meter.train_s,
                "wall_seconds": train_wall, "samples_processed": sum(r["samples_processed"] for r in ranks),
                "ranks": ranks, "checkpoint": last_checkpoint, "overlap_epochs": self.plan.overlap_epochs,
                "eval_every": self.plan.eval_every, "device": str(self.device), **more, **extra}
