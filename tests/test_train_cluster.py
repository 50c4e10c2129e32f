"""Not only local[*]: a Spark standalone cluster on localhost (a master and two 1-core workers
started with pyspark's own ``bin/spark-class``) runs a 2-worker training through
``spark-submit jobs/train.py --master spark://...`` with each launcher; then it is stopped.
Both launchers train the same seeded AR-SGD run, so their final parameters agree."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from pipeline.train.comm.ports import free_port

pytest_plugins = ["train_fixtures"]
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def standalone(tmp_path):
    import pyspark

    spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               SPARK_LOG_DIR=str(tmp_path / "logs"), SPARK_WORKER_DIR=str(tmp_path / "work"))
    port, ui = free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    procs = []
    logs = []
    try:
        def start(args, name):
            log = open(tmp_path / f"{name}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen([str(spark_class), *args], env=env, stdout=log, stderr=subprocess.STDOUT))

        start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
               "--webui-port", str(ui)], "master")
        for i in range(2):
            start(["org.apache.spark.deploy.worker.Worker", "--cores", "1", "--memory", "2g",
                   "--webui-port", str(free_port()), "--work-dir", str(tmp_path / f"work{i}"), url], f"worker{i}")
        deadline = time.time() + 180
        alive = 0
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as r:
                    alive = json.load(r).get("aliveworkers", 0)
            except OSError:
                alive = 0
            if alive == 2:
                break
            time.sleep(2)
        assert alive == 2, (tmp_path / "master.log").read_text()[-2000:]
        yield url, env
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()


@pytest.mark.timeout(2400)
@pytest.mark.needs_horovod
def test_two_worker_training_on_a_standalone_cluster_with_each_launcher(standalone, digit_shards_2, tmp_path):
    url, env = standalone
    params = {}
    for launcher in ("horovod", "torch"):
        out = tmp_path / f"train_{launcher}"
        cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", url, "--total-executor-cores", "2",
               "--executor-cores", "1", "--executor-memory", "1g", "--driver-memory", "1g",
               "--conf", f"spark.pyspark.python={sys.executable}",
               "jobs/train.py", "--manifest", str(digit_shards_2), "--output", str(out), "--launcher", launcher,
               "--max_steps", "6", "--epochs", "1", "--batch_size", "16", "--progress", "false"]
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stderr[-3000:]
        s = json.loads((out / "summary.json").read_text())
        assert s["launcher"] == launcher and s["workers"] == 2 and s["steps"] == 6
        assert len(set(s["final_digests"])) == 1
        params[launcher] = torch.load(out / "model.pt", weights_only=False)["model"]
    for k, v in params["horovod"].items():
        assert torch.allclose(v, params["torch"][k], atol=1e-6), k
