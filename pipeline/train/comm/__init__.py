"""Communication layer: one interface (base.Communicator), several backends, and the transport of
the asynchronous algorithms.

``make_communicator("horovod" | "torch" | "local" | "inprocess", device_kind=...)`` builds the backend a
launcher asks for; backend modules are imported lazily so that using one never imports the
others. ``device.py`` resolves a worker's device and the torch.distributed backend that
follows from it; ``rendezvous.py`` decides where the sockets listen and serves the rendezvous
store; ``ports.py`` finds a free rendezvous port; ``fusion.py`` flattens tensor lists and packs
them into buckets. The asynchronous algorithms' transport: ``p2p.py`` (pair channels),
``round_server.py`` (their serving threads), ``liveness.py`` (heartbeats: dead, not slow).
"""
from .base import Communicator, CommStats, DeviceMismatch, Group  # noqa: F401


def make_communicator(kind: str, bucket_bytes: int = 4 << 20, device_kind: str = "cpu",
                      bind_address: str | None = None) -> Communicator:
    """The ``kind`` backend; ``device_kind`` (cpu | cuda, see ``device.py``) picks torch.distributed's
    gloo or NCCL (Horovod stages CUDA tensors itself when its build is CPU-only); ``bind_address``:
    the address torch.distributed's sockets listen on (``rendezvous.py``)."""
    if kind == "horovod":
        from .horovod import HorovodCommunicator

        return HorovodCommunicator(bucket_bytes=bucket_bytes)
    if kind == "torch":
        from .torch_dist import TorchDistCommunicator

        return TorchDistCommunicator(bucket_bytes=bucket_bytes, device_kind=device_kind, bind_address=bind_address)
    if kind == "local":
        from .local import LocalCommunicator

        return LocalCommunicator()
    if kind == "inprocess":
        from .inprocess import current

        return current(device_kind)
    raise ValueError(f"unknown communicator {kind!r} (horovod | torch | local | inprocess)")
