"""Which GPU a Spark-launched worker gets, and what TorchDistributor may do with GPUs.

* :func:`task_gpu` -- the GPU Spark assigned to the task a worker runs in (Horovod-on-Spark
  records it through its task service; TorchDistributor sets ``CUDA_VISIBLE_DEVICES`` itself).
* :func:`torch_use_gpu` -- TorchDistributor's ``use_gpu`` from the config, never from whether the
  driver sees CUDA.
* :func:`check_torch_gpus` -- exactly one GPU per worker for a NCCL world, checked on the driver
  before any process starts.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from ..errors import ConfigError


def task_gpu(resources: Optional[Mapping[str, Any]] = None) -> Optional[int]:
    """The GPU Spark assigned to this task (the first address of its ``gpu`` resource), None when
    it has none. ``resources`` defaults to what the task sees: inside a Horovod-on-Spark worker
    the resources Horovod fetched from the task's ``TaskContext``, else ``TaskContext.get()``."""
    if resources is None:
        resources = _task_resources()
    gpu = (resources or {}).get("gpu")
    addresses = list(getattr(gpu, "addresses", gpu) or [])
    return int(addresses[0]) if addresses else None


def _task_resources() -> Mapping[str, Any]:
    try:
        from horovod.spark.task.task_info import get_available_devices

        gpus = get_available_devices()   # the GPU addresses Horovod took from the task's TaskContext
        if gpus:
            return {"gpu": list(gpus)}
    except ImportError:
        pass
    try:
        from pyspark import TaskContext
    except ImportError:
        return {}
    tc = TaskContext.get()
    return tc.resources() if tc is not None else {}


def torch_use_gpu(device: str, local_mode: bool, spark_conf: Mapping[str, str]) -> bool:
    """TorchDistributor's ``use_gpu``, from the config only (the driver often has no GPU):
    ``device=cuda`` -> True, ``cpu`` -> False, ``auto`` -> whether Spark gives GPUs to the
    processes (``spark.task.resource.gpu.amount``, or the driver's amount in local mode)."""
    if device != "auto":
        return device == "cuda"
    return _gpu_amount(local_mode, spark_conf)[2] > 0


def _gpu_amount(local_mode: bool, spark_conf: Mapping[str, str]) -> tuple[str, Optional[str], float]:
    """(key, raw value, amount) of the GPUs Spark gives the processes: the driver's in local mode,
    else a task's."""
    key = "spark.driver.resource.gpu.amount" if local_mode else "spark.task.resource.gpu.amount"
    raw = spark_conf.get(key)
    try:
        return key, raw, float(raw or 0)
    except ValueError:
        raise ConfigError(f"invalid Spark setting {key}={raw!r}: expected a number") from None


def check_torch_gpus(world: int, local_mode: bool, spark_conf: Mapping[str, str]) -> None:
    """A NCCL world takes one whole GPU per worker (two ranks on one GPU are refused by NCCL).
    TorchDistributor on CUDA starts, in local mode, at most as many processes as the driver has GPUs
    (``spark.driver.resource.gpu.amount``; it would silently start fewer than the plan's workers),
    and on a cluster ceil(world / amount) tasks of ``spark.task.resource.gpu.amount`` GPUs each,
    every one told ``--nnodes=world``: an amount of anything but exactly 1 either shares a GPU (below
    1) or starts fewer nodes than the rendezvous waits for (above 1: it hangs). Refuse, in one line
    naming the setting, what would not give every worker exactly one GPU of its own."""
    key, raw, amount = _gpu_amount(local_mode, spark_conf)
    if local_mode and amount < world:
        raise ConfigError(f"invalid Spark setting {key}={raw!r}: launcher=torch in local mode with device=cuda runs "
                          f"one process per GPU of the driver, and {world} workers need {world} GPUs (NCCL cannot "
                          "put two workers on one GPU); use fewer workers, more GPUs or device=cpu")
    if not local_mode and amount != 1:
        raise ConfigError(f"invalid Spark setting {key}={raw!r}: launcher=torch with device=cuda needs exactly one "
                          "GPU per task (NCCL cannot put two workers on one GPU, and TorchDistributor starts "
                          "ceil(workers / amount) tasks that each wait for all the workers): set it to 1 and give "
                          "the executors GPUs (spark.executor.resource.gpu.amount and its discoveryScript)")
