"""A rendezvous port is chosen where the kernel never hands out ports by itself.

A port taken with bind(0) comes from the ephemeral range, the same range every outgoing
connection's local port is drawn from; between our check and the store's bind, any connection on
the machine may take it (EADDRINUSE: a failed run). Below that range only an explicit bind can."""
from __future__ import annotations

import socket

from pipeline.train.comm.ports import ephemeral_range, free_port


def test_the_ephemeral_range_is_read_from_the_kernel():
    low, high = ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert (low, high) == tuple(int(x) for x in f.read().split())


def test_a_free_port_is_below_the_ephemeral_range_bindable_and_not_always_the_same():
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), ports
    assert len(set(ports)) > 10, ports        # drawn at random: parallel runs do not follow each other
    with socket.socket() as s:                 # free now: a listener can take it
        s.bind(("127.0.0.1", ports[-1]))
        s.listen()


def test_a_port_in_use_is_never_returned():
    low, _ = ephemeral_range()
    held = []
    try:     # hold every port but one of a small window, and ask within that window
        for p in range(low - 40, low):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                s.close()
                continue
            held.append(s)
        free = held.pop()
        port = free.getsockname()[1]
        free.close()
        assert free_port(lowest=low - 40) == port
    finally:
        for s in held:
            s.close()
