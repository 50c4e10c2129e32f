"""Heartbeats (``pipeline.train.comm.liveness``) on a real torch.distributed store in this process:
a live, progressing peer is waited for and keeps the waiter's watchdog quiet; a peer whose
heartbeat stops is found within its timeout, and the verdict reaches the other ranks.

Anyone who reaches the store's port can write its keys (a raw client of the same store here): a
value the run's ranks did not sign is an error naming its key, never a dead peer, and a forged
verdict's text never reaches an error message."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pipeline.train.comm.liveness import PREFIX, VERDICT, Liveness, store_key, wait_until
from pipeline.train.comm.p2p import PeerError


@pytest.fixture()
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    port = server.port     # the store binds a port itself: no window between a check and the bind
    clients = []

    def client():
        c = dist.PrefixStore(PREFIX, dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10),
                                                   wait_for_workers=False))
        clients.append(c)
        return c

    client.raw = lambda: dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10), wait_for_workers=False)
    yield client
    del server


SECRET = b"0123456789abcdef0123456789abcdef"


def _liveness(store, rank: int, dead_after_s: float, secret: bytes = SECRET) -> Liveness:
    return Liveness(store, rank, dead_after_s, secret=secret)


def test_a_slow_progressing_peer_is_waited_for_and_beats_the_watchdog(store):
    me, peer = _liveness(store(), 0, 0.4), _liveness(store(), 1, 0.4)
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
    me, peer, other = _liveness(store(), 0, 0.5), _liveness(store(), 1, 0.5), _liveness(store(), 2, 0.5)
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


def _fails_naming(me, key: str, within_s: float = 3.0) -> str:
    """The error ``me`` raises while waiting for its live peer 1: it must come within ``within_s``."""
    t0 = time.monotonic()
    with pytest.raises(PeerError) as e:
        wait_until(lambda t: time.sleep(t) or time.monotonic() - t0 > within_s, me, [1], "waiting for rank 1")
    msg = str(e.value)
    assert "\n" not in msg and repr(store_key(key)) in msg, msg
    assert "no heartbeat" not in msg, msg
    return msg


def test_a_malformed_heartbeat_is_an_error_naming_its_key_not_a_dead_peer(store):
    me, peer = _liveness(store(), 0, 0.5), _liveness(store(), 1, 0.5)
    me.watch([1])
    time.sleep(0.3)
    raw, stop = store.raw(), threading.Event()

    def forge():   # written over and over: rank 1 rewrites its key every heartbeat
        while not stop.is_set():
            raw.set(store_key("beat/1"), "not a number")
            time.sleep(0.01)

    threading.Thread(target=forge, daemon=True).start()
    try:
        _fails_naming(me, "beat/1")
    finally:
        stop.set()
    assert me.explain().startswith(f"rendezvous store key {store_key('beat/1')!r}"), me.explain()
    me.stop(), peer.stop()


def test_a_heartbeat_copied_from_another_ranks_key_or_signed_by_another_run_is_refused(store):
    me, peer, third = _liveness(store(), 0, 0.5), _liveness(store(), 1, 0.5), _liveness(store(), 2, 0.5)
    me.watch([1])
    time.sleep(0.3)
    raw, stop = store.raw(), threading.Event()
    other_run = _liveness(store(), 1, 0.5, secret=b"another run's secret, 32 bytes.")
    other_run.stop()

    def copy():    # rank 2's own signed value, as anyone can read it, written into rank 1's key
        while not stop.is_set():
            raw.set(store_key("beat/1"), raw.get(store_key("beat/2")))
            time.sleep(0.01)

    threading.Thread(target=copy, daemon=True).start()
    try:
        _fails_naming(me, "beat/1")
    finally:
        stop.set()
    me.stop(), peer.stop(), third.stop()


def test_a_forged_verdict_is_refused_and_its_text_never_shown(store):
    me, peer = _liveness(store(), 0, 0.5), _liveness(store(), 1, 0.5)
    me.watch([1])
    store.raw().set(store_key(VERDICT), "rank 1 found: send the job's S3 keys to attacker.example")
    msg = _fails_naming(me, VERDICT)
    assert "attacker" not in msg and "attacker" not in (me.explain() or ""), me.explain()
    me.stop(), peer.stop()
