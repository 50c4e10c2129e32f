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

Anyone who reaches ``MASTER_ADDR:MASTER_PORT`` can read and write the store's keys (torch's store
has no authentication). So what the ranks exchange there themselves (the heartbeats and verdicts of
:mod:`.liveness`) is signed with a per-run secret, the way Horovod signs its services: the launcher
makes one (:func:`new_run_secret`) and hands it to its workers with their arguments (through Spark
for TorchDistributor, through the spawn pipe for the local launcher), never in the driver's
environment; a worker finds it in ``PIPELINE_RUN_SECRET`` (:func:`run_secret`). A value is
``<payload> <HMAC-SHA256(secret, key, payload)>`` (:func:`signed`); one that is not signed for its
key with the run's secret is a :class:`StoreValueError` naming the key (:func:`verified`). torch's
own rendezvous keys (the gloo pairs' addresses) are not ours to sign: docs/training.md#trust-model.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
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


# ---------------------------------------------------------------------------- the run's secret
RUN_SECRET_ENV = "PIPELINE_RUN_SECRET"
MAX_VALUE = 4096          # no value of ours is longer: a longer one is refused before it is parsed


class StoreValueError(ValueError):
    """A value in the rendezvous store that is malformed or not signed with the run's secret."""


def new_run_secret() -> str:
    """A fresh per-run secret (a launcher makes one per launch of its workers)."""
    return secrets.token_hex(32)


def run_secret() -> bytes:
    """This worker's run secret; ConfigError (one line) when its launcher gave it none."""
    value = os.environ.get(RUN_SECRET_ENV, "")
    if len(value) < 32:
        raise ConfigError(f"no run secret in {RUN_SECRET_ENV}: the workers of an asynchronous run sign their "
                          "heartbeats with the secret their launcher hands out (launcher=local or torch)")
    return value.encode()


def _mac(secret: bytes, key: str, payload: bytes) -> str:
    return hmac.new(secret, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest()


def signed(secret: bytes, key: str, payload: str) -> bytes:
    """``payload`` signed for store key ``key`` (the full key, prefix included)."""
    data = payload.encode()
    return data + b" " + _mac(secret, key, data).encode()


def verified(secret: bytes, key: str, value: bytes) -> str:
    """The payload of ``value`` read from store key ``key``; StoreValueError naming the key when the
    value is not one :func:`signed` made for that key with ``secret`` (forged, corrupted, copied
    from another key, or written by another run on the same port)."""
    if len(value) > MAX_VALUE:
        raise StoreValueError(f"rendezvous store key {key!r}: a value of {len(value)} bytes, over {MAX_VALUE}: "
                              "not written by this run's ranks")
    data, _, mac = bytes(value).rpartition(b" ")
    if not data or not hmac.compare_digest(mac, _mac(secret, key, data).encode()):
        raise StoreValueError(f"rendezvous store key {key!r}: a value not signed with this run's secret (forged or "
                              "corrupted by someone who reaches MASTER_ADDR:MASTER_PORT, or another run's)")
    return data.decode("utf-8", errors="replace")
