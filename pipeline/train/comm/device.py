"""Which device a worker trains on, and which torch.distributed backend follows from it.

Pure functions of their inputs (the CUDA probe and the GPU Spark assigned to the task are
arguments), so every case is testable on a CPU-only host:

* :func:`device_kind` -- ``"cpu"`` or ``"cuda"`` from the requested device (``auto`` | ``cpu``
  | ``cuda``) and whether CUDA is available. ``device=cpu`` stays on the CPU on a GPU host;
  ``device=cuda`` without CUDA is a ConfigError.
* :func:`pick_device` -- the concrete ``torch.device``: on CUDA, the GPU Spark assigned to
  this task (``assigned_gpu``, from ``TaskContext.resources()["gpu"]``) when there is one,
  else ``local_rank % device_count``.
* :func:`torch_backend` -- ``nccl`` only for CUDA tensors, ``gloo`` for CPU tensors.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from ...errors import ConfigError

DeviceKind = Literal["cpu", "cuda"]


def device_kind(requested: str, cuda_available: bool) -> DeviceKind:
    """``cpu`` or ``cuda`` for ``requested`` in auto | cpu | cuda."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"invalid config value device={requested!r}: expected auto|cpu|cuda")
    if requested == "cpu":
        return "cpu"
    if cuda_available:
        return "cuda"
    if requested == "cuda":
        raise ConfigError("invalid config value device='cuda': CUDA is not available on this worker")
    return "cpu"


def pick_device(requested: str, *, cuda_available: bool, local_rank: int = 0, device_count: int = 0,
                assigned_gpu: Optional[int] = None) -> torch.device:
    """The device of one worker (see module docstring); does not touch CUDA itself."""
    if device_kind(requested, cuda_available) == "cpu":
        return torch.device("cpu")
    if assigned_gpu is not None:
        if device_count and not (0 <= int(assigned_gpu) < device_count):
            raise ConfigError(f"assigned GPU {assigned_gpu} is not one of the {device_count} visible CUDA devices")
        return torch.device("cuda", int(assigned_gpu))
    return torch.device("cuda", int(local_rank) % max(1, int(device_count)))


def torch_backend(kind: DeviceKind) -> str:
    """The torch.distributed backend for tensors on ``kind``: nccl for cuda, gloo for cpu."""
    return "nccl" if kind == "cuda" else "gloo"


def current_device(requested: str, local_rank: int, assigned_gpu: Optional[int] = None) -> torch.device:
    """:func:`pick_device` with this process's CUDA probe; selects the GPU when there is one."""
    avail = torch.cuda.is_available()
    dev = pick_device(requested, cuda_available=avail, local_rank=local_rank,
                      device_count=torch.cuda.device_count() if avail else 0, assigned_gpu=assigned_gpu)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev
