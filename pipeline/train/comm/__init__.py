"""Communication layer: one interface (base.Communicator), several backends.

``make_communicator("horovod" | "torch" | "local")`` builds the backend a launcher asks for;
backend modules are imported lazily so that using one never imports the others.
"""
from .base import Communicator, CommStats, Group  # noqa: F401


def make_communicator(kind: str, bucket_bytes: int = 4 << 20) -> Communicator:
    if kind == "horovod":
        from .horovod import HorovodCommunicator

        return HorovodCommunicator(bucket_bytes=bucket_bytes)
    if kind == "torch":
        from .torch_dist import TorchDistCommunicator

        return TorchDistCommunicator(bucket_bytes=bucket_bytes)
    if kind == "local":
        from .local import LocalCommunicator

        return LocalCommunicator()
    raise ValueError(f"unknown communicator {kind!r} (horovod | torch | local)")
