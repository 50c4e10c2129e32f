"""Real storage servers on loopback for the remote-data tests: Debian's XRootD server and moto's
S3 server (installed by ``scripts/test_services.sh``, which ``make test`` runs first).

Each fixture starts its server on a free port, waits until it answers, and stops it afterwards.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipeline.train.comm.ports import free_port

S3_VENV = Path(os.environ.get("PIPELINE_S3_SERVER_VENV",
                              Path.home() / ".cache" / "hep-pipeline" / "s3server-venv"))

# moto enforces IAM once this many requests have been served; the bucket and the two users the
# tests need are created within them (see _S3_SETUP)
_NO_AUTH_ACTIONS = 8
_S3_SETUP = r"""
import boto3, json, sys
ep = sys.argv[1]
kw = dict(endpoint_url=ep, region_name="us-east-1", aws_access_key_id="admin", aws_secret_access_key="admin")
s3, iam = boto3.client("s3", **kw), boto3.client("iam", **kw)
s3.create_bucket(Bucket="pipeline-test")
out = {}
for user, actions in (("writer", ["s3:*"]),
                      ("reader", ["s3:GetObject", "s3:ListBucket", "s3:HeadBucket", "s3:GetBucketLocation"])):
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName=user, PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
    k = iam.create_access_key(UserName=user)["AccessKey"]
    out[user] = [k["AccessKeyId"], k["SecretAccessKey"]]
print(json.dumps(out))
"""


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def _wait_ready(ready, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} was not ready within {timeout:.0f} s")


@contextlib.contextmanager
def _process(cmd: list[str], port: int, what: str, log: Path, env: dict | None = None,
             pass_fds: tuple = (), ready=None) -> Iterator[subprocess.Popen]:
    """``cmd`` started in a session of its own, ready when ``ready()`` holds (default: ``port`` accepts
    connections), stopped (the whole process group) at the end."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                pass_fds=pass_fds)
    try:
        _wait_ready(ready or (lambda: _port_open(port)), proc, what)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class XRootD:
    port: int
    root: Path          # the directory the test asked to export
    served: Path        # the server's own copy of it (what the URLs name)
    proc: subprocess.Popen

    def url(self, path: Path | str) -> str:
        """The ``root://`` URL of ``path`` (``root`` or a path under it)."""
        rel = Path(path).absolute().relative_to(self.root.absolute())
        return f"root://127.0.0.1:{self.port}/{(self.served / rel).as_posix().rstrip('/.') or '/'}"


def _serving_copy(export: Path) -> Path:
    """A directory made for the server (``nobody`` reads it) holding ``export``'s tree: files
    hard-linked when they are world-readable and on the same filesystem, else copied. Nothing
    outside it changes permissions; the caller removes it."""
    served = Path(tempfile.mkdtemp(prefix="pipeline-xrootd-"))
    served.chmod(0o755)
    for d in served.parents:
        if not d.stat().st_mode & 0o001:
            shutil.rmtree(served)
            raise RuntimeError(f"{d} is not searchable by other users, so the XRootD server (user nobody) cannot "
                               "reach its export below it: point TMPDIR at a directory every user may enter")
    for src in sorted(export.rglob("*")):
        dst = served / src.relative_to(export)
        if src.is_dir():
            dst.mkdir(mode=0o755)
            dst.chmod(0o755)
            continue
        try:
            if not src.stat().st_mode & 0o004:
                raise OSError("not world-readable: copy it")
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
            dst.chmod(0o644)
    return served


# exec argv[2:] with the socket argv[1] as fd 3 and systemd's variables naming it (the pid stays the same)
_SOCKET_ACTIVATION = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
os.execv(sys.argv[2], sys.argv[2:])
"""


def _listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


@contextlib.contextmanager
def xrootd_server(export: Path, log_dir: Path) -> Iterator[XRootD]:
    """``xrootd`` serving the files under ``export`` on loopback only (as user nobody: it refuses to run as root).

    The server reads a copy of ``export`` made for it (:func:`_serving_copy`: the files as they are
    when the server starts), so no directory of the caller's changes permissions. XRootD has no
    bind-address setting; it takes its listening socket from systemd's socket-activation protocol
    (``LISTEN_FDS``/``LISTEN_PID``, fd 3), so the socket is created here, bound to 127.0.0.1."""
    binary = shutil.which("xrootd")
    if binary is None:
        raise RuntimeError("xrootd is not installed: run scripts/test_services.sh (Debian package xrootd-server)")
    export.mkdir(parents=True, exist_ok=True)
    served = _serving_copy(export)
    sock = _listening_socket()
    try:
        port, fd = sock.getsockname()[1], sock.fileno()
        cmd = [sys.executable, "-c", _SOCKET_ACTIVATION, str(fd),
               binary, "-R", "nobody", "-p", str(port), str(served)]     # logs to stderr -> xrootd.out
        log = log_dir / "xrootd.out"

        def ready() -> bool:    # the socket accepts connections before xrootd serves them: wait for its start line
            return log.is_file() and b"initialization completed" in log.read_bytes()

        with _process(cmd, port, "xrootd", log, pass_fds=(fd,), ready=ready) as proc:
            sock.close()
            yield XRootD(port, export, served, proc)
    finally:
        sock.close()
        shutil.rmtree(served, ignore_errors=True)


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    keys: dict          # user -> (access key, secret key): "writer" (s3:*) and "reader" (read only)
    proc: subprocess.Popen

    def env(self, user: str = "writer") -> dict:
        key, secret = self.keys[user]
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server(log_dir: Path) -> Iterator[S3Server]:
    """moto's S3 server on loopback with one bucket, a read-write and a read-only user."""
    server = S3_VENV / "bin" / "moto_server"
    if not server.exists():
        raise RuntimeError(f"{server} is missing: run scripts/test_services.sh")
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_NO_AUTH_ACTIONS)}
    with _process([str(server), "-H", "127.0.0.1", "-p", str(port)], port, "moto_server",
                  log_dir / "moto.out", env=env) as proc:
        endpoint = f"http://127.0.0.1:{port}"
        out = subprocess.run([str(S3_VENV / "bin" / "python"), "-c", _S3_SETUP, endpoint],
                             capture_output=True, text=True, timeout=120, check=True)
        yield S3Server(endpoint, "pipeline-test", json.loads(out.stdout), proc)


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a block (restored afterwards)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
