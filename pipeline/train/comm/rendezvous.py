"""Where the training stage's torch.distributed sockets listen, and its rendezvous store.

Every socket a worker opens listens on ONE address, never on all interfaces:

* :func:`bind_address` -- the address a rank advertises: ``train.bind_address`` when set, else
  the address this machine uses to reach ``MASTER_ADDR`` (the interface the cluster talks on;
  loopback when ``MASTER_ADDR`` is local, as under the local launcher);
* :func:`use_interface` -- gloo's and NCCL's pair sockets listen on the interface of that
  address (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the environment sets them);
* :func:`tcp_store` -- rank 0 serves the rendezvous store from a socket bound to ``MASTER_ADDR``
  only (torch's own store would listen on every interface), the others connect to it.

A process started by torchrun (``TORCHELASTIC_USE_AGENT_STORE``) uses the store of torchrun's
agent instead and opens no store socket itself (docs/training.md lists every socket).
"""
from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Optional

from ...errors import ConfigError


def _resolve(host: str) -> tuple[int, str]:
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0]
    except socket.gaierror as e:
        raise ConfigError(f"invalid config value: host {host!r} does not resolve ({e.strerror})") from None
    return family, addr[0]


def route_address(host: str) -> str:
    """The local address this machine uses to reach ``host`` (the source address of its route)."""
    family, addr = _resolve(host)
    if ipaddress.ip_address(addr).is_loopback:
        return addr
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))   # no packet is sent: this only asks the kernel for the route
        return s.getsockname()[0]


def interface_of(address: str) -> str:
    """The network interface holding ``address``; ConfigError (one line) when none does."""
    import psutil

    want = ipaddress.ip_address(address)
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) == want:
                        return name
                except ValueError:
                    continue
    raise ConfigError(f"invalid config value bind_address={address!r}: no network interface of this machine has it")


def bind_address(setting: Optional[str], master_addr: str) -> str:
    """The address this rank listens on: ``setting`` (a host name or address of this machine) when
    given, else the local address of the route to ``master_addr``."""
    if setting:
        address = _resolve(setting)[1]
        interface_of(address)   # refuse an address this machine does not have, in one line
        return address
    return route_address(master_addr)


def use_interface(address: str) -> str:
    """Make gloo and NCCL listen on the interface of ``address`` (the environment's own setting
    wins); returns the interface name."""
    iface = interface_of(address)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
    return iface


def tcp_store(rank: int, world: int, master_addr: str, port: int, timeout: timedelta):
    """The rendezvous store: rank 0 serves it from a socket bound to ``master_addr``'s address
    only; every other rank connects to it."""
    import torch.distributed as dist

    family, address = _resolve(master_addr)
    if rank != 0:
        return dist.TCPStore(master_addr, port, world, False, timeout)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(max(128, world))
    except OSError as e:
        sock.close()
        raise ConfigError(f"rank 0 cannot serve the rendezvous store on {address}:{port} ({e.strerror}): MASTER_ADDR "
                          "must be an address of rank 0's machine and MASTER_PORT free") from None
    return dist.TCPStore(master_addr, port, world, True, timeout, master_listen_fd=sock.detach())


def uses_agent_store() -> bool:
    """True in a process started by torchrun, which reuses the store of torchrun's agent."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
