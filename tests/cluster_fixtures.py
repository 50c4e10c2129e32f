"""Spark standalone clusters on loopback for the cluster tests: a master and workers started with
pyspark's own ``bin/spark-class``.

``standalone_cluster(log_dir, isolated=True)`` gives workers that **share no disk with the driver**,
like the nodes of a real cluster: each worker runs in a mount namespace of its own
(``unshare --mount --propagation private``; ``--user --map-root-user`` when not root) with a private
tmpfs over the driver's temporary directory (``/tmp``: the driver's scratch space and, usually,
pytest's tmp root), pytest's tmp root wherever it is, and the checkout (its ``runs/`` and the
project's code). Only the virtualenv is mounted back inside the hidden checkout: it is the node's
"image" (Python, PySpark, torch, Horovod), and it holds no project code (the package is an editable
install pointing at the hidden checkout). The code reaches the executors as it would on a real
cluster: ``spark-submit --archives hep-code.zip#hep`` of ``pipeline/`` and ``schemas/``
(:func:`code_archive`), served by the driver and unpacked in each executor's working directory,
with ``spark.executorEnv.PYTHONPATH=hep`` (the tasks and the processes they start import it). A file a task writes to a driver path lands on the worker's private tmpfs and never
reaches the driver; data travels through the servers only (moto S3, XRootD, Spark's own RPC).

``isolated=False`` starts the same cluster with workers that see the driver's files (the shared-disk
setup of a single machine).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from pipeline.fs import S3_ENV_VARS
from pipeline.train.comm.ports import free_port

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
# what the workers must NOT have of their own: the S3 settings (a job brings them) and a Python path
_NODE_UNSET = (*S3_ENV_VARS, "PYTHONPATH")

# run in the worker's new mount namespace: hide PIPELINE_HIDE (':'-separated) under private tmpfs,
# mount the image (PIPELINE_IMAGE, opened before the hiding) back in place, then exec the worker
_ISOLATE = r"""
set -e
cd /
exec 5<"$PIPELINE_IMAGE"
IFS=:
for d in $PIPELINE_HIDE; do
    mkdir -p "$d"
    mount -t tmpfs -o mode=1777,size=4g pipeline-private "$d"
done
unset IFS
mkdir -p "$PIPELINE_IMAGE"
mount --no-canonicalize --bind /proc/self/fd/5 "$PIPELINE_IMAGE"
exec 5<&-
exec "$@"
"""


def code_archive(dest: Path) -> Path:
    """The project as ``spark-submit --archives`` ships it to the executors: ``pipeline/`` and the
    ``schemas/`` it reads beside it, in a zip."""
    out = dest / "hep-code.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        files = [*(REPO / "pipeline").rglob("*.py"), *(REPO / "schemas").rglob("*.json")]
        for f in sorted(f for f in files if "__pycache__" not in f.parts):
            z.write(f, f.relative_to(REPO).as_posix())
    return out


def hidden_paths(basetemp: Optional[Path]) -> list[str]:
    """What a worker must not see: the driver's temporary directory, pytest's tmp root, the checkout."""
    paths = {Path(tempfile.gettempdir()).resolve(), REPO.resolve()}
    if basetemp is not None:
        paths.add(Path(basetemp).resolve())
    # a path under another hidden one is hidden with it
    keep = sorted(p for p in paths if not any(q != p and p.is_relative_to(q) for q in paths))
    return [str(p) for p in keep]


def _namespace_cmd() -> list[str]:
    if shutil.which("unshare") is None:
        raise RuntimeError("unshare (util-linux) is needed to start workers that cannot see the driver's files")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--propagation", "private", "--", "sh", "-c", _ISOLATE, "isolate"]


@dataclass
class Worker:
    index: int
    proc: Optional[subprocess.Popen] = None
    log: Optional[object] = None


@dataclass
class Cluster:
    """A running standalone cluster: ``url`` is its master; ``submit`` runs a driver against it."""

    url: str
    ui: int
    log_dir: Path
    code: Path
    isolated: bool
    hide: list[str]
    workers: list[Worker] = field(default_factory=list)
    _spark_class: Path = field(default=Path(), repr=False)
    _master: Optional[subprocess.Popen] = field(default=None, repr=False)
    _logs: list = field(default_factory=list, repr=False)

    # ------------------------------------------------------------------ drivers
    def driver_env(self, **extra: str) -> dict:
        env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                   SPARK_LOCAL_IP="127.0.0.1", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def submit_cmd(self, *args: str, conf: Optional[dict] = None) -> list[str]:
        """``spark-submit`` against this cluster, the project's code shipped with ``--archives``."""
        cmd = [str(VENV / "bin" / "spark-submit"), "--master", self.url, "--total-executor-cores", "2",
               "--executor-cores", "1", "--executor-memory", "1g", "--driver-memory", "1g",
               "--archives", f"{self.code}#hep", "--conf", "spark.executorEnv.PYTHONPATH=hep",
               "--conf", f"spark.pyspark.python={sys.executable}",
               "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
               # jobs start once both executors registered (slow to start on a loaded machine)
               "--conf", "spark.scheduler.minRegisteredResourcesRatio=1.0",
               # both workers have the host name 127.0.0.1 but no common disk: an executor must fetch
               # another's shuffle blocks over the network, not read its files as a same-host neighbour's
               "--conf", "spark.shuffle.readHostLocalDisk=false",
               "--conf", "spark.scheduler.maxRegisteredResourcesWaitingTime=180s"]
        if os.environ.get("SPARK_SUBMIT_OPTS"):
            # the executors run with the JVM options the tests give every driver (tests/conftest.py)
            cmd += ["--conf", f"spark.executor.extraJavaOptions={os.environ['SPARK_SUBMIT_OPTS']}"]
        for k, v in (conf or {}).items():
            cmd += ["--conf", f"{k}={v}"]
        return cmd + list(args)

    def submit(self, *args: str, conf: Optional[dict] = None, env: Optional[dict] = None, cwd: Path = REPO,
               timeout: float = 1200) -> subprocess.CompletedProcess:
        """Run a driver (a ``jobs/*.py`` or any script) against the cluster; the completed process."""
        return subprocess.run(self.submit_cmd(*args, conf=conf), cwd=cwd, env=env or self.driver_env(),
                              capture_output=True, text=True, timeout=timeout)

    def popen(self, *args: str, conf: Optional[dict] = None, env: Optional[dict] = None, cwd: Path = REPO,
              **kw) -> subprocess.Popen:
        return subprocess.Popen(self.submit_cmd(*args, conf=conf), cwd=cwd, env=env or self.driver_env(), **kw)

    # ------------------------------------------------------------------ workers
    def start_worker(self, i: int) -> None:
        w = self.workers[i]
        env = {k: v for k, v in os.environ.items() if k not in _NODE_UNSET}
        env.update(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_LOG_DIR=f"/tmp/spark-worker{i}/logs", SPARK_WORKER_DIR=f"/tmp/spark-worker{i}/work",
                   PIPELINE_IMAGE=str(VENV), PIPELINE_HIDE=":".join(self.hide))
        if not self.isolated:
            env.update(SPARK_LOG_DIR=str(self.log_dir / f"worker{i}"), SPARK_WORKER_DIR=str(self.log_dir / f"work{i}"))
        cmd = [str(self._spark_class), "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
               "--cores", "1", "--memory", "2g", "--webui-port", str(free_port()),
               "--work-dir", env["SPARK_WORKER_DIR"], self.url]
        if self.isolated:
            cmd = _namespace_cmd() + cmd
        w.log = open(self.log_dir / f"worker{i}.log", "a")
        self._logs.append(w.log)
        w.proc = subprocess.Popen(cmd, env=env, stdout=w.log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill_worker(self, i: int) -> None:
        """The node is lost: its worker, executor and Python workers are SIGKILLed at once."""
        w = self.workers[i]
        if w.proc is not None and w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
            w.proc.wait(timeout=30)

    def alive_workers(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui}/json/", timeout=5) as r:
                return int(json.load(r).get("aliveworkers", 0))
        except OSError:
            return 0

    def wait_workers(self, n: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_workers() == n:
                return
            for w in self.workers:
                if w.proc is not None and w.proc.poll() is not None and n == len(self.workers):
                    raise RuntimeError(f"worker {w.index} exited with code {w.proc.returncode}:\n"
                                       + self.logs(f"worker{w.index}.log"))
            time.sleep(1)
        raise RuntimeError(f"{n} workers did not register within {timeout:.0f} s:\n" + self.logs("master.log"))

    def worker_pids(self, i: int) -> list[int]:
        """The worker's process and everything it started (executor JVM, Python workers)."""
        import psutil

        w = self.workers[i]
        if w.proc is None or w.proc.poll() is not None:
            return []
        root = psutil.Process(w.proc.pid)
        return [root.pid] + [c.pid for c in root.children(recursive=True)]

    def read_worker_file(self, i: int, path: str) -> Optional[str]:
        """A file as worker ``i`` sees it (entered through its mount namespace): debugging aid."""
        w = self.workers[i]
        if w.proc is None or w.proc.poll() is not None:
            return None
        cmd = ["nsenter", "-t", str(w.proc.pid), "-m", "--", "cat", path] if self.isolated else ["cat", path]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    def executor_logs(self, tail: int = 4000) -> str:
        """The newest stdout and stderr files of each worker's executors (in its private work directory)."""
        out = []
        for w in self.workers:
            if w.proc is None or w.proc.poll() is not None:
                continue
            work = f"/tmp/spark-worker{w.index}/work" if self.isolated else str(self.log_dir / f"work{w.index}")
            find = ["find", work, "-name", "stderr", "-o", "-name", "stdout"]
            if self.isolated:
                find = ["nsenter", "-t", str(w.proc.pid), "-m", "--", *find]
            files = sorted(subprocess.run(find, capture_output=True, text=True).stdout.split())
            for f in files[-4:]:        # the newest application's executor (app-<time>-<n>/<id>/)
                text = self.read_worker_file(w.index, f) or ""
                out.append(f"--- worker {w.index}: {f}\n{text[-tail:]}")
        return "\n".join(out)

    def logs(self, name: str, tail: int = 3000) -> str:
        p = self.log_dir / name
        return p.read_text(errors="replace")[-tail:] if p.is_file() else ""

    def stop(self) -> None:
        for i in range(len(self.workers)):
            self.kill_worker(i)
        if self._master is not None and self._master.poll() is None:
            self._master.terminate()
            try:
                self._master.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._master.kill()
                self._master.wait()
        for f in self._logs:
            f.close()


@contextlib.contextmanager
def standalone_cluster(log_dir: Path, workers: int = 2, isolated: bool = True,
                       basetemp: Optional[Path] = None) -> Iterator[Cluster]:
    """A master and ``workers`` one-core workers on 127.0.0.1 (see the module docstring)."""
    import pyspark

    log_dir.mkdir(parents=True, exist_ok=True)
    spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
    port, ui = free_port(), free_port()
    cluster = Cluster(url=f"spark://127.0.0.1:{port}", ui=ui, log_dir=log_dir, code=code_archive(log_dir),
                      isolated=isolated, hide=hidden_paths(basetemp) if isolated else [],
                      workers=[Worker(i) for i in range(workers)], _spark_class=spark_class)
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(log_dir / "master"))
    try:
        log = open(log_dir / "master.log", "w")
        cluster._logs.append(log)
        cluster._master = subprocess.Popen(
            [str(spark_class), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
             "--webui-port", str(ui)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for i in range(workers):
            cluster.start_worker(i)
        cluster.wait_workers(workers)
        yield cluster
    finally:
        cluster.stop()


def listening_sockets(pids: Sequence[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of these processes."""
    import psutil

    out = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.add((c.laddr.ip, c.laddr.port))
    return out
