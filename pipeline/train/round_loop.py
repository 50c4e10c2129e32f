"""The training loop driven by ROUNDS, for algorithms whose workers take different step counts.

``loop._Run.run`` hands over to :func:`run_rounds` when the algorithm has
``variable_steps`` (time-budgeted local SGD / SwarmSGD, SwarmSGD with geometric H, SlowMo
around them; see ``algorithms/rounds.py``). The per-step body is the same as the fixed-step
loop's (same reader, learning-rate schedule, straggler simulator around the compute step);
what differs is the clock:

* the run lasts ``ceil(total_steps / H)`` rounds, H = the algorithm's
  ``nominal_steps_per_round``: the same sample budget as a fixed-H run when workers keep pace;
  a slow worker processes fewer samples, a fast one more;
* each worker cycles through its own shard, epoch after epoch (reader seeded per epoch),
  until the last round ends: there is no shared "end of epoch" when step counts differ;
* the learning-rate schedule (warmup, scaling) is evaluated at step ``rounds_done * H``, the
  same for every worker in a round;
* validation happens at round boundaries, every ``ceil(eval_every / H)`` rounds (all workers
  are there together), and the round clock is restarted after it;
* checkpoints: only the final one (``checkpoint_every`` is ignored with a warning; ``resume``
  needs a step count shared by all workers and is refused with a ConfigError).

Metrics: ``step`` and ``samples_per_s`` in the records are rank 0's local steps (times M);
``rounds`` is added; the summary's ``samples_processed`` is the true sum over workers.
"""
from __future__ import annotations

import logging
import math
import sys
import time

log = logging.getLogger(__name__)


def run_rounds(run) -> dict:
    """Run ``run`` (a ``loop._Run`` whose algorithm has ``variable_steps``) by rounds."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from ..data.reader import ShardReader, epoch_seed
    from ..errors import ConfigError
    from .metrics import MetricsWriter, wire_bytes_written
    from .schedule import lr_at, set_lr
    from .stragglers import StragglerSimulator

    cfg, plan, comm, algo = run.cfg, run.plan, run.comm, run.algo
    if cfg.resume:
        raise ConfigError(f"invalid config value resume=True with algorithm {cfg.algorithm.name!r}: resuming is not "
                          "supported when workers take different numbers of steps per round")
    if cfg.checkpoint_every and run.rank == 0:
        log.warning("checkpoint_every=%d ignored: with a different step count per worker only the final "
                    "checkpoint is written", cfg.checkpoint_every)
    H = max(1, int(getattr(algo, "nominal_steps_per_round", 1)))
    total_rounds = max(1, math.ceil(plan["total_steps"] / H))
    eval_rounds = max(1, math.ceil(plan["eval_every"] / H))
    stragglers = getattr(run, "stragglers", None) or StragglerSimulator(getattr(cfg, "stragglers", None), run.rank)
    run.writer = MetricsWriter(run.out_dir, run.history, cfg.tensorboard) if run.rank == 0 else None
    spe, b = plan["steps_per_epoch"], cfg.batch_size
    eval_path = plan["eval"][cfg.eval_split] if cfg.eval_split in plan["eval"] else plan["eval"]["test"]
    t_start = time.perf_counter()
    train_s = 0.0
    mark = {"t": 0.0, "comm": comm.stats.seconds, "step": run.step, "loss": 0.0, "n": 0}
    wire0 = wire_bytes_written()
    bytes0 = comm.stats.bytes_sent
    bar = tqdm(total=total_rounds, desc="rounds", disable=not (cfg.progress and run.rank == 0), file=sys.stderr,
               mininterval=1.0, leave=False, ncols=90)
    epoch, finished, last_eval_round = 0, False, 0
    if hasattr(algo, "reset_clock"):
        algo.reset_clock()
    while not finished:
        seed = epoch_seed(cfg.seed, run.shard.seed, epoch)
        with ShardReader(run.shard.path, b, plan["features"], seed=seed, shuffle_buffer=cfg.shuffle_buffer,
                         scaling=run.scaling, device=run.device) as reader:
            for inputs, y in reader.batches(limit_batches=spe):
                t0 = time.perf_counter()
                # the schedule follows the ROUND clock (rounds x H), so every worker uses the same lr in a
                # round whatever its local step count (SlowMo's outer step depends on it)
                set_lr(run.optimizer, lr_at(algo.rounds_done * H, cfg.lr, run.world, cfg.lr_scaling,
                                            plan["warmup_steps"]))
                algo.zero_grad()
                with stragglers.compute():
                    loss = F.cross_entropy(run.model(*inputs), y)
                    loss.backward()
                algo.step()
                run.step += 1
                train_s += time.perf_counter() - t0
                mark["loss"] += float(loss.detach())
                mark["n"] += 1
                if not algo.round_finished:
                    continue
                r = algo.rounds_done
                bar.update(1)
                if r >= total_rounds:
                    finished = True
                    break
                if r % eval_rounds == 0:
                    _log_eval(run, eval_path, cfg.eval_split, train_s, mark, wire0, bytes0, r)
                    last_eval_round = r
                    if hasattr(algo, "reset_clock"):
                        algo.reset_clock()
        epoch += 1
    bar.close()
    if not algo.in_sync():
        run.averager.average_()
    train_wall = time.perf_counter() - t_start
    if algo.rounds_done != last_eval_round:
        _log_eval(run, eval_path, cfg.eval_split, train_s, mark, wire0, bytes0, algo.rounds_done)
    test = run.evaluate(plan["eval"]["test"])
    rec = run._record("test", test, train_s, mark, wire0, bytes0)
    rec["rounds"] = algo.rounds_done
    if run.rank == 0:
        run.writer.write(rec)
        run.writer.close()
        torch.save({"model": run.model.state_dict(), "model_name": cfg.model, "num_classes": plan["num_classes"],
                    "shape": plan.get("shape"), "step": run.step}, f"{run.out_dir}/model.pt")
    from . import loop

    last_ckpt = run.save_checkpoint(run.elapsed0 + train_wall)
    mine = {"rank": run.rank, "steps": run.step, "samples_processed": run.step * b, "rounds": algo.rounds_done,
            "final_digest": loop.param_digest(run.model.parameters()), "digests": run.digests,
            "comm": comm.stats.snapshot(), "train_seconds": train_s, **stragglers.stats()}
    with comm.stats_paused():
        ranks = comm.allgather_object(mine)
    return {"rank": run.rank, "world": run.world, "steps": run.step, "test_accuracy": test["accuracy"],
            "test_loss": test["loss"], "auc": test["auc"], "train_seconds": train_s, "wall_seconds": train_wall,
            "samples_processed": sum(r["samples_processed"] for r in ranks), "ranks": ranks,
            "checkpoint": last_ckpt, "overlap_epochs": plan["overlap_epochs"], "eval_every": plan["eval_every"],
            "device": str(run.device), "rounds": algo.rounds_done}


def _log_eval(run, path, split, train_s, mark, wire0, bytes0, rounds) -> None:
    res = run.evaluate(path)
    rec = run._record(split, res, train_s, mark, wire0, bytes0)
    rec["rounds"] = rounds
    if run.rank == 0:
        run.writer.write(rec)
        print(f"[train] round {rounds} step {rec['step']} {split} loss {rec['loss']:.4f} acc {rec['accuracy']:.4f}",
              file=sys.stderr, flush=True)
