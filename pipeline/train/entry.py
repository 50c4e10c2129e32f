"""The worker entry point: what every worker process runs under every launcher.

``worker_entry(cfg_json, backend, plan, out_dir, ckpt_dir, assigned_gpu=None)`` resolves the
device (``comm.device``; the GPU Spark assigned to the task when given), builds the
communicator whose torch.distributed backend follows that device, builds the
:class:`~.worker.Worker` and hands it to the driver the algorithm needs
(:func:`~.drivers.driver_for`).
"""
from __future__ import annotations

from typing import Optional

from .drivers import driver_for
from .watchdog import Watchdog
from .worker import Worker


def worker_entry(cfg_json: str, backend: str, plan: dict, out_dir: str, ckpt_dir: str,
                 assigned_gpu: Optional[int] = None) -> dict:
    """What every worker process runs (Horovod-on-Spark task, torchrun process, local process).

    ``assigned_gpu``: the GPU index Spark assigned to this task (``TaskContext.resources()["gpu"]``),
    used instead of ``local_rank % device_count`` when the run is on CUDA.
    """
    import torch

    from .comm import make_communicator
    from .comm.device import current_device, device_kind
    from .config import TrainConfig

    cfg = TrainConfig.model_validate_json(cfg_json)
    torch.set_num_threads(cfg.threads_per_worker)
    kind = device_kind(cfg.device, torch.cuda.is_available())
    comm = make_communicator(backend, bucket_bytes=int(cfg.bucket_mb * (1 << 20)), device_kind=kind,
                             bind_address=cfg.bind_address)
    # "local" (one worker) and "inprocess" run inside the caller's process: never end that process
    # (inprocess: the launcher's stall limit, over the beats of comm.stall_watch())
    dog = comm.stall_watch() if backend == "inprocess" else Watchdog(cfg.stall_timeout if backend != "local" else 0,
                                                                       comm.rank)
    w: Optional[Worker] = None
    try:
        device = current_device(cfg.device, comm.local_rank, assigned_gpu)
        comm.bind_device(device)
        w = Worker(cfg, comm, plan, out_dir, ckpt_dir, device, watchdog=dog)
        result = driver_for(w.algo)(w)
    except BaseException:
        dog.failing()  # the cleanup below must not hang a failed worker (and with it the launch)
        raise
    finally:
        if w is not None:
            w.algo.close()
        comm.shutdown()
    dog.stop()
    return result
