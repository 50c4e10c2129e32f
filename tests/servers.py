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


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on port {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout:.0f} s")


@contextlib.contextmanager
def _process(cmd: list[str], port: int, what: str, log: Path, env: dict | None = None) -> Iterator[subprocess.Popen]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_port(port, proc, what)
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
    root: Path          # the directory the server exports
    proc: subprocess.Popen

    def url(self, path: Path | str) -> str:
        return f"root://127.0.0.1:{self.port}/{Path(path).absolute()}"


@contextlib.contextmanager
def xrootd_server(export: Path, log_dir: Path) -> Iterator[XRootD]:
    """``xrootd`` exporting ``export`` on loopback (as user nobody: it refuses to run as root)."""
    binary = shutil.which("xrootd")
    if binary is None:
        raise RuntimeError("xrootd is not installed: run scripts/test_services.sh (Debian package xrootd-server)")
    export.mkdir(parents=True, exist_ok=True)
    for d in [export, *export.parents]:           # nobody must be able to read the export
        if d == Path("/"):
            break
        d.chmod(d.stat().st_mode | 0o005)
    port = free_port()
    cmd = [binary, "-R", "nobody", "-p", str(port), str(export)]     # logs to stderr -> xrootd.out
    with _process(cmd, port, "xrootd", log_dir / "xrootd.out") as proc:
        yield XRootD(port, export, proc)


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
