"""The sockets of the training stage: every listening socket of a real 2-worker run is bound to
the address the cluster uses (here: the loopback the local launcher advertises), never to all
interfaces; and what travels between workers is tensors: a non-tensor payload is refused.
"""
from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch

from async_fixtures import results, run_procs
from pipeline.train.config import TrainConfig
from pipeline.train.launch import train
from train_fixtures import write_digit_shards

ALL_INTERFACES = {"0.0.0.0", "::", ""}


class ListenerLog:
    """Polls the listening TCP sockets of the processes this process starts while a run goes on
    (psutil); processes already running before (the session's Spark JVM, test servers) are not
    the run's."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.seen: dict[tuple[int, str, int], None] = {}
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(period_s,), daemon=True)

    def _poll(self, period_s: float) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            for child in me.children(recursive=True):
                if child.pid in self.before:
                    continue
                try:
                    conns = child.net_connections(kind="inet")
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                for c in conns:
                    if c.status == psutil.CONN_LISTEN:
                        self.seen[(child.pid, c.laddr.ip, c.laddr.port)] = None
                        self.pids.add(child.pid)
            self._stop.wait(period_s)

    def __enter__(self):
        self.before = {p.pid for p in psutil.Process().children(recursive=True)}
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


@pytest.mark.cluster
def test_a_two_worker_run_listens_only_on_the_advertised_address(tmp_path):
    """EA-wild on 2 local workers (world group, the centre's pair channel, the rendezvous store):
    every socket any worker listens on is bound to 127.0.0.1."""
    man = write_digit_shards(tmp_path / "shards", workers=2, n_train=512, n_test=64, n_val=64)
    cfg = TrainConfig(manifest=str(man), output=str(tmp_path / "out"), launcher="local", model="lenet5", epochs=3,
                      batch_size=32, max_steps=24, progress=False, max_restarts=0,
                      algorithm={"name": "eawild", "params": {"round_steps": 4}})
    with ListenerLog() as log:
        s = train(cfg)
    assert s["steps"] == 24
    addresses = {ip for _, ip, _ in log.seen}
    assert len(log.pids) >= 2 and len(log.seen) >= 4, log.seen   # both workers: store, world and pair groups
    assert not addresses & ALL_INTERFACES, sorted(log.seen)
    assert addresses == {"127.0.0.1"}, sorted(log.seen)


def _send_objects(rank, world):
    """Rank 0 tries to send a non-tensor over a pair channel and to gather a non-JSON object."""
    from pipeline.train.comm.p2p import P2PChannel
    from pipeline.train.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    ch = P2PChannel([(0, 1)])
    out = {}
    if rank == 0:
        for name, payload in (("dict", {"weights": [1.0]}), ("array", __import__("numpy").zeros(3))):
            try:
                ch.send(payload, 1)
                out[name] = None
            except TypeError as e:
                out[name] = str(e)
    try:
        comm.allgather_object({"rank": rank, "blob": object()})   # refused on every rank, before any traffic
        out["gather"] = None
    except TypeError as e:
        out["gather"] = str(e)
    out["plain"] = comm.allgather_object({"rank": rank, "ok": [1, 2.5, "x", None, True]})
    got = torch.zeros(1)                                # tensors still travel
    if rank == 0:
        ch.send(torch.tensor([float(rank)]), 1)
        ch.recv(got, 1)
    else:
        ch.recv(got, 0)
        ch.send(torch.tensor([float(rank)]), 0)
    out["tensor"] = float(got)
    return out


@pytest.mark.cluster
def test_only_tensors_and_plain_data_travel_between_workers():
    res = results(run_procs(_send_objects, 2))
    for name in ("dict", "array"):
        msg = res[0][name]
        assert msg is not None and "\n" not in msg and "tensor" in msg, msg
    for r in res:
        assert r["gather"] is not None and "\n" not in r["gather"] and "object" in r["gather"], r["gather"]
        assert r["plain"] == [{"rank": 0, "ok": [1, 2.5, "x", None, True]}, {"rank": 1, "ok": [1, 2.5, "x", None, True]}]
    assert [r["tensor"] for r in res] == [1.0, 0.0]
