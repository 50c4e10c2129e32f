"""The pipeline on a Spark standalone cluster whose workers share no disk with the driver
(tests/cluster_fixtures.py: each worker in a mount namespace of its own, private tmpfs over the
driver's /tmp, pytest's tmp root and the checkout; the code shipped with ``--py-files``). Storage is
the moto S3 server, ROOT inputs come from the XRootD server (tests/servers.py), all on loopback.

One cluster serves every case of the module. First the isolation itself is proven (a task's write
to a driver path never reaches the driver, a driver file is invisible to the tasks, the code the
executors run is the shipped zip), then the pipeline's stages run on it end to end.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cluster_fixtures import REPO, listening_sockets, standalone_cluster
from servers import s3_server

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with standalone_cluster(tmp_path_factory.mktemp("cluster"), basetemp=tmp_path_factory.getbasetemp()) as c:
        yield c


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


# a driver that runs one task per worker; each task looks for a driver file, writes a file at a
# driver path and reads it back, and reports what it saw and where its code came from
_PROBE = r'''
import json, os, sys, time
from pyspark.sql import SparkSession

driver_file, task_file = sys.argv[1], sys.argv[2]
spark = SparkSession.builder.appName("isolation-probe").getOrCreate()


def probe(_):
    import pipeline
    time.sleep(2)    # keep the first executor busy, so that the other one takes a task too
    saw_driver_file = os.path.exists(driver_file)
    os.makedirs(os.path.dirname(task_file), exist_ok=True)
    with open(task_file, "w") as f:
        f.write("written by a task")
    with open(task_file) as f:
        read_back = f.read()
    yield {"namespace": os.readlink("/proc/self/ns/mnt"), "saw_driver_file": saw_driver_file,
           "read_back": read_back, "code": os.path.abspath(pipeline.__file__),
           "checkout_visible": os.path.exists(os.path.join(os.environ["PIPELINE_REPO"], "pipeline"))}


rows = spark.sparkContext.parallelize(range(4), 4).mapPartitions(probe).collect()
print("PROBE " + json.dumps({"driver_namespace": os.readlink("/proc/self/ns/mnt"), "tasks": rows}))
spark.stop()
'''


def test_tasks_cannot_see_the_drivers_files_and_their_writes_never_reach_it(cluster, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    driver_file = tmp_path / "driver-only.txt"
    driver_file.write_text("the driver's")
    task_file = tmp_path / "from-task" / "out.txt"
    r = cluster.submit(str(script), str(driver_file), str(task_file),
                       conf={"spark.executorEnv.PIPELINE_REPO": str(REPO)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + cluster.executor_logs()
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PROBE "))[6:])
    tasks = out["tasks"]
    assert len(tasks) == 4
    # every task ran in a worker's own mount namespace, and both workers took tasks
    namespaces = {t["namespace"] for t in tasks}
    assert out["driver_namespace"] not in namespaces and len(namespaces) == 2, out
    # a driver file is invisible to the tasks; the file a task wrote at a driver path is real for the task...
    assert not any(t["saw_driver_file"] for t in tasks)
    assert all(t["read_back"] == "written by a task" for t in tasks)
    # ...and never reaches the driver
    assert not task_file.exists() and not task_file.parent.exists()
    # the code came with --py-files, not from the checkout (which the workers cannot see)
    assert not any(t["checkout_visible"] for t in tasks)
    assert all(t["code"].startswith("/tmp/spark-worker") and "pipeline.zip" in t["code"] for t in tasks), tasks


def test_the_cluster_listens_on_loopback_only(cluster):
    pids = [cluster._master.pid] + [p for i in range(len(cluster.workers)) for p in cluster.worker_pids(i)]
    sockets = listening_sockets(pids)
    assert len(sockets) >= 3 and all(_loopback(ip) for ip, _ in sockets), sockets  # master, 2 workers (+ UIs)


def _loopback(ip: str) -> bool:
    import ipaddress

    a = ipaddress.ip_address(ip)
    return (getattr(a, "ipv4_mapped", None) or a).is_loopback
