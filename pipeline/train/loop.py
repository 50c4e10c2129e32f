"""The per-worker training function: the same code under every launcher.

``worker_entry(cfg_json, backend, plan, out_dir, ckpt_dir)`` runs in each worker process
(a Horovod-on-Spark task, a TorchDistributor/torchrun process, or a local process). It

1. builds the communicator (``horovod`` | ``torch`` | ``local``) and picks the device
   (``cuda:<local rank>`` when CUDA is available and allowed, else CPU);
2. seeds everything from ``cfg.seed``, builds the model (rank 0's initial state is broadcast),
   the base optimizer, the averaging policy and the algorithm from the registry;
3. optionally resumes from the newest checkpoint (every rank's state, see checkpoint.py);
4. runs E_overlap = ceil(E_target / C) passes over ITS OWN shard (``plan["overlap_epochs"]``),
   each pass ``plan["steps_per_epoch"]`` = min over workers of rows // b steps so every rank
   takes the same number of steps; the reader is seeded per (worker, epoch);
5. validates every ``plan["eval_every"]`` = ceil(N / B_global) steps and at the end, evaluating
   the consensus model (world average of the parameters when the algorithm leaves the workers
   apart; each rank scores a 1/M slice of the split and the predictions are gathered);
6. writes metrics (JSON lines) and checkpoints from rank 0, averages diverged parameters once
   more at the end, evaluates on the test split and returns a summary dict.

Communication used only for bookkeeping (initial broadcast, evaluation, checkpoint gathering)
is excluded from the communication statistics.
"""
from __future__ import annotations

import hashlib
import logging
import random
import sys
import time
from typing import Optional

import numpy as np

log = logging.getLogger(__name__)


def pick_device(requested: str, local_rank: int):
    import torch

    from ..errors import ConfigError

    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    if requested == "cuda":
        raise ConfigError("invalid config value device='cuda': CUDA is not available on this worker")
    return torch.device("cpu")


def param_digest(params) -> str:
    import torch

    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in params])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)


def make_optimizer(cfg, params):
    import torch

    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class _Run:
    """State of one worker's training run (kept small: the loop body lives in ``run``)."""

    def __init__(self, cfg, comm, plan: dict, out_dir: str, ckpt_dir: str):
        import torch

        from ..data.reader import load_manifest, load_scaling
        from .algorithms import BuildContext, build_algorithm
        from .algorithms.averaging import ModelAverager, bn_buffers
        from .models import build_model

        self.cfg, self.comm, self.plan = cfg, comm, plan
        self.out_dir, self.ckpt_dir = out_dir, ckpt_dir
        self.rank, self.world = comm.rank, comm.world_size
        self.manifest = load_manifest(cfg.manifest)
        if self.world != self.manifest.num_workers:
            from ..errors import BadInputError

            raise BadInputError(f"{cfg.manifest}: {self.manifest.num_workers} worker shards but {self.world} workers")
        self.shard = self.manifest.workers[self.rank]
        self.device = pick_device(cfg.device, comm.local_rank)
        self.scaling = load_scaling(plan.get("scaling"))
        seed_everything(cfg.seed)
        self.model = build_model(cfg.model, plan["num_classes"], plan.get("shape")).to(self.device)
        self.optimizer = make_optimizer(cfg, self.model.parameters())
        self.averager = ModelAverager(self.model, self.optimizer, comm, cfg.policy.batchnorm, cfg.policy.momentum)
        ctx = BuildContext(self.model, self.optimizer, comm, self.averager,
                           groups=[w.group for w in self.manifest.workers])
        self.algo = build_algorithm(cfg.algorithm.name, cfg.algorithm.params, ctx)
        self.bn = bn_buffers(self.model)
        from .stragglers import StragglerSimulator  # issue 7: simulated slow workers (off by default)

        self.stragglers = StragglerSimulator(cfg.stragglers, self.rank)
        with comm.stats_paused():
            comm.broadcast_([t for t in self.model.state_dict().values()], root=0)
        self.step = 0
        self.elapsed0 = 0.0
        self.history: list[dict] = []
        self.digests: list[str] = []
        self.torch = torch

    # ------------------------------------------------------------------ checkpoints
    def try_resume(self) -> None:
        from . import checkpoint

        path = checkpoint.latest(self.ckpt_dir) if self.cfg.resume else None
        if path is None:
            if self.cfg.resume and self.rank == 0:
                log.info("resume: no checkpoint in %s, starting fresh", self.ckpt_dir)
            return
        ck = checkpoint.load(path, checkpoint.fingerprint(self.cfg, self.world))
        checkpoint.load_rank_state(ck["ranks"][self.rank], self.model, self.optimizer, self.algo, self.device)
        self.step, self.elapsed0, self.history = int(ck["step"]), float(ck["elapsed_s"]), list(ck["metrics"])
        if self.rank == 0:
            log.info("resumed from %s at step %d", path, self.step)

    def save_checkpoint(self, elapsed: float) -> Optional[str]:
        from . import checkpoint

        with self.comm.stats_paused():
            states = self.comm.allgather_object(checkpoint.rank_state(self.model, self.optimizer, self.algo))
        if self.rank != 0:
            return None
        payload = {"step": self.step, "elapsed_s": elapsed, "fingerprint": checkpoint.fingerprint(self.cfg, self.world),
                   "metrics": list(self.writer.history) if self.writer else [], "ranks": states}
        return str(checkpoint.save(self.ckpt_dir, self.step, payload))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, path: str) -> dict:
        import torch
        import torch.nn.functional as F

        from ..data.reader import read_all
        from .metrics import summarize

        cfg = self.cfg
        consensus = [p.data for p in self.model.parameters()] if not self.algo.in_sync() else []
        if cfg.policy.batchnorm == "average":
            consensus += self.bn
        with self.comm.stats_paused():
            from .consensus import consensus_distance  # issue 7: logged at every evaluation

            spread = consensus_distance([p.data for p in self.model.parameters()], self.comm) if consensus else 0.0
            backup = [t.clone() for t in consensus]
            if consensus:
                self.comm.allreduce_mean_(consensus)
            self.model.eval()
            probs, labels, loss_sum = [], [], 0.0
            with torch.no_grad():
                for inputs, y in read_all(path, self.plan["features"], self.scaling, 512, self.rank, self.world):
                    inputs = tuple(t.to(self.device) for t in inputs)
                    out = self.model(*inputs)
                    loss_sum += float(F.cross_entropy(out, y.to(self.device), reduction="sum"))
                    probs.append(torch.softmax(out.float(), 1).cpu().numpy())
                    labels.append(y.numpy())
            self.model.train()
            for t, b in zip(consensus, backup):
                t.copy_(b)
            k = self.plan["num_classes"]
            mine = (np.concatenate(probs) if probs else np.zeros((0, k), np.float32),
                    np.concatenate(labels) if labels else np.zeros(0, np.int64), loss_sum)
            parts = self.comm.allgather_object(mine)
        return {**summarize(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                            sum(p[2] for p in parts)), "consensus_distance": spread}

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        import torch
        import torch.nn.functional as F
        from tqdm import tqdm

        from ..data.reader import ShardReader, epoch_seed
        from .metrics import MetricsWriter, wire_bytes_written
        from .schedule import lr_at, set_lr

        cfg, plan, comm = self.cfg, self.plan, self.comm
        if getattr(self.algo, "variable_steps", False):  # issue 7: per-worker step counts differ
            from .round_loop import run_rounds

            return run_rounds(self)
        self.try_resume()
        self.writer = MetricsWriter(self.out_dir, self.history, cfg.tensorboard) if self.rank == 0 else None
        spe, total, b = plan["steps_per_epoch"], plan["total_steps"], cfg.batch_size
        eval_every = plan["eval_every"]
        eval_path = plan["eval"][cfg.eval_split] if cfg.eval_split in plan["eval"] else plan["eval"]["test"]
        t_start = time.perf_counter()
        train_s = 0.0
        mark = {"t": 0.0, "comm": comm.stats.seconds, "step": self.step, "loss": 0.0, "n": 0}
        whole_run = dict(mark)  # the final (test) record reports rates over the whole run
        wire0 = wire_bytes_written()
        bytes0 = comm.stats.bytes_sent
        last_ckpt = None
        epoch, offset = divmod(self.step, spe)
        while self.step < total:
            seed = epoch_seed(cfg.seed, self.shard.seed, epoch)
            todo = min(spe - offset, total - self.step)
            bar = tqdm(total=spe, initial=offset, desc=f"epoch {epoch + 1}/{plan['overlap_epochs']}",
                       disable=not (cfg.progress and self.rank == 0), file=sys.stderr, mininterval=1.0,
                       leave=False, dynamic_ncols=False, ncols=90)
            done = 0
            with ShardReader(self.shard.path, b, plan["features"], seed=seed, shuffle_buffer=cfg.shuffle_buffer,
                             scaling=self.scaling, device=self.device) as reader:
                for inputs, y in reader.batches(skip_batches=offset, limit_batches=offset + todo):
                    t0 = time.perf_counter()
                    set_lr(self.optimizer, lr_at(self.step, cfg.lr, self.world, cfg.lr_scaling, plan["warmup_steps"]))
                    self.algo.zero_grad()
                    with self.stragglers.compute():
                        loss = F.cross_entropy(self.model(*inputs), y)
                        loss.backward()
                    self.algo.step()
                    self.step += 1
                    done += 1
                    train_s += time.perf_counter() - t0
                    for mk in (mark, whole_run):
                        mk["loss"] += float(loss.detach())
                        mk["n"] += 1
                    bar.update(1)
                    if cfg.record_param_digests:
                        self.digests.append(param_digest(self.model.parameters()))
                    if cfg.fail_at_step is not None and self.step == cfg.fail_at_step:
                        raise RuntimeError(f"fail_at_step={cfg.fail_at_step} reached (simulated crash)")
                    if self.step % eval_every == 0 and self.step < total:
                        self._log_eval(eval_path, cfg.eval_split, train_s, mark, wire0, bytes0)
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < total:
                        last_ckpt = self.save_checkpoint(self.elapsed0 + time.perf_counter() - t_start)
            bar.close()
            if done != todo:
                raise RuntimeError(f"worker {self.rank}: shard {self.shard.path} gave {done} batches in epoch "
                                   f"{epoch}, expected {todo}")
            epoch, offset = epoch + 1, 0
        # the final model is one model: average once more if the algorithm left workers apart
        if not self.algo.in_sync():
            self.averager.average_()
        train_wall = time.perf_counter() - t_start
        if mark["n"] and self.step % eval_every:
            self._log_eval(eval_path, cfg.eval_split, train_s, mark, wire0, bytes0)
        test = self.evaluate(plan["eval"]["test"])
        rec = self._record("test", test, train_s, whole_run, wire0, bytes0)
        if self.rank == 0:
            self.writer.write(rec)
            self.writer.close()
            torch.save({"model": self.model.state_dict(), "model_name": cfg.model, "num_classes": plan["num_classes"],
                        "shape": plan.get("shape"), "step": self.step}, f"{self.out_dir}/model.pt")
        last_ckpt = self.save_checkpoint(self.elapsed0 + train_wall) or last_ckpt
        mine = {"rank": self.rank, "steps": self.step, "samples_processed": self.step * b,
                "final_digest": param_digest(self.model.parameters()), "digests": self.digests,
                "comm": comm.stats.snapshot(), "train_seconds": train_s}
        with comm.stats_paused():
            ranks = comm.allgather_object(mine)
        return {"rank": self.rank, "world": self.world, "steps": self.step, "test_accuracy": test["accuracy"],
                "test_loss": test["loss"], "auc": test["auc"], "train_seconds": train_s, "wall_seconds": train_wall,
                "samples_processed": sum(r["samples_processed"] for r in ranks), "ranks": ranks,
                "checkpoint": last_ckpt, "overlap_epochs": plan["overlap_epochs"], "eval_every": eval_every,
                "device": str(self.device)}

    def _record(self, split: str, res: dict, train_s: float, mark: dict, wire0, bytes0) -> dict:
        from .metrics import wire_bytes_written

        comm, plan = self.comm, self.plan
        steps = self.step - mark["step"]
        dt = max(train_s - mark["t"], 1e-9)
        wire = wire_bytes_written()
        epoch = round(self.step / plan.get("epoch_steps", plan["eval_every"]), 4)
        rec = {"kind": "eval", "split": split, "step": self.step, "epoch": epoch,
               "wall_s": round(self.elapsed0 + train_s, 3), "loss": res["loss"], "accuracy": res["accuracy"],
               "auc": res["auc"], "n_eval": res["n"],
               "train_loss": (mark["loss"] / mark["n"]) if mark["n"] else None,
               "samples_per_s": (steps * self.cfg.batch_size * self.world / dt) if steps else None,
               "comm_fraction": ((comm.stats.seconds - mark["comm"]) / dt) if steps else None,
               "bytes_sent": comm.stats.bytes_sent - bytes0,
               "bytes_sent_per_step": (comm.stats.bytes_sent - bytes0) / max(self.step, 1),
               "wire_bytes_written": (wire - wire0) if wire is not None and wire0 is not None else None,
               "consensus_distance": res.get("consensus_distance")}
        mark.update({"t": train_s, "comm": comm.stats.seconds, "step": self.step, "loss": 0.0, "n": 0})
        return rec

    def _log_eval(self, path: str, split: str, train_s: float, mark: dict, wire0, bytes0) -> None:
        res = self.evaluate(path)
        rec = self._record(split, res, train_s, mark, wire0, bytes0)
        if self.rank == 0:
            self.writer.write(rec)
            print(f"[train] step {rec['step']} epoch {rec['epoch']:.2f} {split} loss {rec['loss']:.4f} "
                  f"acc {rec['accuracy']:.4f}", file=sys.stderr, flush=True)


def worker_entry(cfg_json: str, backend: str, plan: dict, out_dir: str, ckpt_dir: str) -> dict:
    """What every worker process runs (Horovod-on-Spark task, torchrun process, local process)."""
    import torch

    from .comm import make_communicator
    from .config import TrainConfig

    cfg = TrainConfig.model_validate_json(cfg_json)
    torch.set_num_threads(cfg.threads_per_worker)
    comm = make_communicator(backend, bucket_bytes=int(cfg.bucket_mb * (1 << 20)))
    try:
        return _Run(cfg, comm, plan, out_dir, ckpt_dir).run()
    finally:
        comm.shutdown()
