"""A free TCP port on this host, for rendezvous addresses (torch.distributed MASTER_PORT, test clusters).

The port is drawn below the kernel's ephemeral range. A port from bind(0) lies inside that range,
which is also where every outgoing connection on the machine gets its local port: between our
check and the listener's bind, any connection may take it, and the listener fails with
EADDRINUSE. Below the range only another explicit bind can take it, and the random start keeps
two runs started together apart."""
from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000            # below: well-known and registered services' usual ports
_LINUX_DEFAULT = (32768, 60999)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks by itself (Linux's default where it cannot be read)."""
    try:
        with open(_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _LINUX_DEFAULT


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", lowest: int = _LOWEST) -> int:
    """A port free on ``host`` now, below the ephemeral range, from a random start.

    Another process can still bind it before use, but no outgoing connection is given it."""
    low, _ = ephemeral_range()
    if lowest < low:
        span = low - lowest
        start = random.SystemRandom().randrange(span)   # not the seeded global generator
        for i in range(span):
            port = lowest + (start + i) % span
            if _bindable(host, port):
                return port
    with socket.socket() as s:      # nothing free below the range: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])
