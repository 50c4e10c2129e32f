"""Heartbeats (``pipeline.train.comm.liveness``) on a real torch.distributed store in this process:
a live, progressing peer is waited for and keeps the waiter's watchdog quiet; a peer whose
heartbeat stops is found within its timeout, and the verdict reaches the other ranks."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pipeline.train.comm.liveness import PREFIX, Liveness, wait_until
from pipeline.train.comm.p2p import PeerError
from pipeline.train.comm.ports import free_port


@pytest.fixture()
def store():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)
    clients = []

    def client():
        c = dist.PrefixStore(PREFIX, dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10),
                                                   wait_for_workers=False))
        clients.append(c)
        return c

    yield client
    del server


def test_a_slow_progressing_peer_is_waited_for_and_beats_the_watchdog(store):
    me, peer = Liveness(store(), 0, 0.4), Liveness(store(), 1, 0.4)
    me.watch([1])
    done = threading.Event()
    beats = []

    def slow_peer():   # 2 s of slow progress: five times the heartbeat timeout
        for _ in range(10):
            time.sleep(0.2)
            peer.note_progress()
        done.set()

    threading.Thread(target=slow_peer, daemon=True).start()
    t0 = time.monotonic()
    wait_until(done.wait, me, [1], "waiting for rank 1", keepalive=lambda: beats.append(time.monotonic()))
    assert time.monotonic() - t0 >= 1.9
    assert len(beats) >= 3, beats     # the watchdog heard of the peer's progress while waiting
    me.stop(), peer.stop()


def test_a_silent_peer_is_found_within_its_timeout_and_the_verdict_reaches_the_others(store):
    me, peer, other = Liveness(store(), 0, 0.5), Liveness(store(), 1, 0.5), Liveness(store(), 2, 0.5)
    me.watch([1])
    time.sleep(0.3)
    assert me.silent([1]) == []
    peer.stop()                     # its heartbeat stops, as a frozen process's does
    t0 = time.monotonic()
    with pytest.raises(PeerError) as e:
        wait_until(lambda t: time.sleep(t) or False, me, [1], "waiting for rank 1")
    assert time.monotonic() - t0 < 2.0
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rank 0: waiting for rank 1: rank 1 sent no heartbeat"), msg
    t_end = time.monotonic() + 5
    while other.explain() is None and time.monotonic() < t_end:   # the heartbeat thread fetches it
        time.sleep(0.05)
    assert other.explain() is not None and "rank 1 sent no heartbeat" in other.explain(), other.explain()
    me.stop(), other.stop()
