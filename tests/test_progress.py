"""Worker output reaches the user as whole lines (pipeline/train/progress.py).

* A real 2-worker Horovod-on-Spark run whose output is not a terminal: no carriage-return
  fragments, no nested rank prefixes (Horovod prefixes every ``\\r`` fragment of a worker's progress
  bar with ``[0]<stderr>:``), and rank 0's validation lines arrive whole, shown by the driver.
* The driver's relay, fed by a reporter in another process over its real TCP channel: one line
  per interval when the output is not a terminal, the workers' lines as they are, nothing from a
  sender without the run's token.
"""
from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shell_fixtures import REPO, VENV_BIN, clean_env

NESTED = re.compile(r"\[\d+\]<std(?:out|err)>:\s*\[\d+\]<std(?:out|err)>:")
PREFIX = re.compile(r"\[\d+\]<std(?:out|err)>:")


@pytest.fixture(scope="module")
def digit_shards(spark, tmp_path_factory) -> Path:
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images
    from pipeline.shards.materialize import ShardConfig, shard

    root = tmp_path_factory.mktemp("progress_shards")
    ingest_images(ImagesIngestConfig(source="sklearn_digits", output=str(root / "dataset"), limit=400), spark=spark)
    shard(ShardConfig(input=str(root / "dataset"), output=str(root / "shards"), workers=2, row_group_rows=32),
          spark=spark)
    return root / "shards" / "manifest.json"


# slow (about 40 s): what is under test is a new shell's job with its own JVM and the output of two Horovod
# worker processes (each imports torch); one epoch with two validations is the least that shows both
@pytest.mark.cluster
@pytest.mark.slow
def test_a_two_worker_horovod_run_prints_whole_lines(digit_shards, tmp_path):
    r = subprocess.run([str(VENV_BIN / "python"), "-m", "jobs.train", "--spark.master", "local[2]",
                        "--manifest", str(digit_shards), "--output", str(tmp_path / "train"), "--launcher", "horovod",
                        "--epochs", "1", "--batch_size", "8", "--eval_every", "5", "--checkpoint_every", "0"],
                       cwd=tmp_path, env=clean_env(), capture_output=True, timeout=900)
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    assert r.returncode == 0, err[-3000:]
    both = out + err
    assert "\r" not in both, [ln for ln in both.split("\n") if "\r" in ln][:3]
    assert not NESTED.search(both), NESTED.search(both).group(0)
    evals = [ln for ln in both.splitlines() if re.match(r"^\[train\] step \d+ epoch [\d.]+ val loss [\d.]+ acc [\d.]+$", ln)]
    assert len(evals) >= 2, both[-3000:]          # 1 epoch of 400 * 0.7 / 16 steps, validated every 5 steps
    assert not any(PREFIX.search(ln) for ln in evals)
    assert out.splitlines()[-1].startswith("SUMMARY train: ")


_SENDER = r'''
import sys, time
from pipeline.train import progress
bar = progress.bar(6, 0, "epoch 1/1", enabled=True)
for i in range(6):
    time.sleep(0.15)
    bar.update(1)
bar.close()
progress.emit("[train] step 6 epoch 1.00 val loss 0.5000 acc 0.7500")
'''


def test_the_relay_shows_interval_lines_and_the_workers_lines():
    from pipeline.train import progress

    shown = io.StringIO()
    with progress.relay(True, "127.0.0.1", stream=shown, interval_s=0.2) as env:
        r = subprocess.run([sys.executable, "-c", _SENDER], cwd=REPO, env={**clean_env(), **env},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    text = shown.getvalue()
    assert r.stdout == "" and r.stderr == "", "the worker printed instead of reporting to the driver"
    assert "\r" not in text
    got = text.splitlines()
    steps = [ln for ln in got if ln.startswith("[train] epoch 1/1: ")]
    assert 2 <= len(steps) <= 6 and steps[-1].startswith("[train] epoch 1/1: 6/6 steps"), got
    assert got[-1] == "[train] step 6 epoch 1.00 val loss 0.5000 acc 0.7500", got


def test_a_sender_without_the_token_is_ignored():
    import json
    import socket

    from pipeline.train import progress

    shown = io.StringIO()
    with progress.relay(True, "127.0.0.1", stream=shown, interval_s=0.0) as env:
        host, port, _token = env[progress.ENV].rsplit(":", 2)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall((json.dumps({"token": "wrong"}) + "\n" + json.dumps({"line": "injected"}) + "\n").encode())
    assert "injected" not in shown.getvalue()


def test_without_a_relay_rank_0_prints_whole_lines(tmp_path):
    """A worker started without the driver's channel (TorchDistributor's executors) prints the same
    whole lines itself, never carriage returns, when its output is not a terminal."""
    r = subprocess.run([sys.executable, "-c", _SENDER.replace("0.15", "0.01")], cwd=REPO, env=clean_env(),
                       capture_output=True, timeout=120)
    err = r.stderr.decode(errors="replace")   # carriage returns kept
    assert r.returncode == 0, err
    assert "\r" not in err and "[train] epoch 1/1: 6/6 steps" in err, err
    assert err.splitlines()[-1] == "[train] step 6 epoch 1.00 val loss 0.5000 acc 0.7500"


@pytest.mark.slow
def test_the_simulation_progress_is_whole_lines_in_a_log(tmp_path):
    """The driver's count of generated events (simulate), written to a pipe: whole lines, the last
    one at the total."""
    r = subprocess.run([str(VENV_BIN / "python"), "-m", "jobs.simulate", "--spark.master", "local[2]",
                        "--set", "processes=[ttbar]", "--set", "events=40", "--set", "events_per_file=20",
                        "--set", f"output={tmp_path / 'sim'}"], cwd=tmp_path, env=clean_env(), capture_output=True,
                       timeout=600)
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")   # carriage returns kept
    assert r.returncode == 0, err[-3000:]
    assert "\r" not in out + err, [ln for ln in err.split("\n") if "\r" in ln][:2]
    assert re.search(r"^simulate: 40/40 ev, [\d.]+ ev/s$", err, re.M), err[-2000:]


@pytest.mark.slow  # two local 2-worker trainings (about 10 s each on 2 idle cores)
def test_each_local_run_reaches_its_own_relay(digit_shards, tmp_path, capsys):
    """Local workers fork from a server that imported torch once (pipeline/train/local_launchers.py):
    each still gets the launching process's environment of the moment, so the second run in the
    same process reports to the second run's relay, not to the first one's closed socket. (capsys
    sees only what this process writes, i.e. the relay's lines, not a worker's own stderr.)"""
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    seen = []
    for i in range(2):
        cfg = TrainConfig(manifest=str(digit_shards), output=str(tmp_path / f"train{i}"), launcher="local",
                          epochs=1, max_steps=6, batch_size=8, eval_every=3, checkpoint_every=0, progress=False)
        train(cfg)
        err = capsys.readouterr().err
        seen.append([ln for ln in err.splitlines() if re.match(r"^\[train\] step \d+ epoch [\d.]+ val loss", ln)])
    assert [len(s) >= 1 for s in seen] == [True, True], seen


# ---------------------------------------------------------------------------- the relay's bounds
# The relay listens on spark.driver.host, which every machine of the cluster network reaches: what
# it reads from a connection and how many connections it serves are bounded before anyone proved
# they hold the run's token.

def _relay_address(env):
    import json

    from pipeline.train import progress

    host, port, token = env[progress.ENV].rsplit(":", 2)
    return (host, int(port)), (json.dumps({"token": token}) + "\n").encode()   # what a worker sends first


def _closed_by_relay(s, within_s: float) -> bool:
    """Whether the relay closes ``s`` within ``within_s`` (EOF or reset on a read)."""
    import socket

    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_sender_without_the_token_is_cut_off_after_the_tokens_length():
    """The token is checked first, on as many bytes as it has: a wrong one followed by a line that
    never ends is refused at once, not read until its end."""
    import socket

    from pipeline.train import progress

    with progress.relay(True, "127.0.0.1", stream=io.StringIO(), interval_s=0.0) as env:
        addr, token = _relay_address(env)
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(b"0" * len(token) + b"x" * 1000)     # as long as the greeting, then no line end
            assert _closed_by_relay(s, 3.0), "the relay kept reading a connection whose token is wrong"


def test_an_oversize_line_is_refused_without_being_buffered():
    """A line over the relay's limit from a sender with the token closes its connection after at
    most that limit (plus the sockets' buffers), never the whole line (64 MiB sent here)."""
    import socket

    from pipeline.train import progress

    total, chunk = 64 << 20, b"x" * (1 << 20)
    shown = io.StringIO()
    with progress.relay(True, "127.0.0.1", stream=shown, interval_s=0.0) as env:
        addr, token = _relay_address(env)
        sent = 0
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(token + b'{"line": "')
            try:
                while sent < total:
                    s.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            except socket.timeout:
                pytest.fail(f"the relay stopped reading after {sent >> 20} MiB but did not close the connection")
    # loopback socket buffers hold a few MiB; the relay itself holds at most its line limit
    assert sent < 24 << 20, f"the relay accepted {sent >> 20} MiB of one line"
    assert "xxx" not in shown.getvalue()


def test_idle_connections_neither_make_threads_nor_stay_open():
    """300 connections that send nothing: the relay starts no thread for them, closes each after
    its hello timeout, and still serves a sender with the token."""
    import json
    import socket
    import threading
    import time

    from pipeline.train import progress

    shown = io.StringIO()
    with progress.relay(True, "127.0.0.1", stream=shown, interval_s=0.0) as env:
        addr, token = _relay_address(env)
        before = threading.active_count()
        idle = [socket.create_connection(addr, timeout=10) for _ in range(300)]
        time.sleep(0.5)
        assert threading.active_count() - before <= 1, threading.active_count() - before
        deadline = time.monotonic() + progress.HELLO_TIMEOUT_S + 3.0
        open_ = [s for s in idle if not _closed_by_relay(s, max(0.01, deadline - time.monotonic()))]
        assert open_ == [], f"{len(open_)} idle connections still open after the hello timeout"
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(token + (json.dumps({"line": "still served"}) + "\n").encode())
            time.sleep(0.3)
        for s in idle:
            s.close()
    assert "still served" in shown.getvalue()
