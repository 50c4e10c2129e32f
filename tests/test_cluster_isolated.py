"""The pipeline on a Spark standalone cluster whose workers share no disk with the driver
(tests/cluster_fixtures.py: each worker in a mount namespace of its own, private tmpfs over the
driver's /tmp, pytest's tmp root and the checkout; the code shipped with ``--archives``). Storage is
the moto S3 server, ROOT inputs come from the XRootD server (tests/servers.py), all on loopback.

One cluster serves every case of the module. First the isolation itself is proven (a task's write
to a driver path never reaches the driver, a driver file is invisible to the tasks, the code the
executors run is the shipped archive), then the pipeline's stages run on it end to end.
"""
from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

from cluster_fixtures import REPO, listening_sockets, standalone_cluster
from servers import s3_server

pytest_plugins = ["train_fixtures"]
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
    try:    # the node has no S3 settings of its own; a task that reaches for the store says which are missing
        from pipeline import fs
        fs.location("s3://bucket/x").filesystem()
        s3_error = None
    except Exception as e:
        s3_error = f"{type(e).__name__}: {e}"
    yield {"s3_settings": sorted(k for k in fs.S3_ENV_VARS if k in os.environ), "s3_error": s3_error,
           "namespace": os.readlink("/proc/self/ns/mnt"), "saw_driver_file": saw_driver_file,
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
    assert r.returncode == 0, _why(r, cluster)
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
    # a worker has no S3 settings of its own (jobs bring them): the store is refused in one line naming them
    assert all(t["s3_settings"] == [] for t in tasks), tasks
    assert all(t["s3_error"].startswith("BadInputError: s3://bucket/x: no S3 credentials: set AWS_ACCESS_KEY_ID")
               and "\n" not in t["s3_error"] for t in tasks), tasks
    # the code came with --archives, not from the checkout (which the workers cannot see)
    assert not any(t["checkout_visible"] for t in tasks)
    assert all(t["code"].startswith("/tmp/spark-worker") and t["code"].endswith("/hep/pipeline/__init__.py")
               for t in tasks), tasks


def test_the_cluster_listens_on_loopback_only(cluster):
    pids = [cluster._master.pid] + [p for i in range(len(cluster.workers)) for p in cluster.worker_pids(i)]
    sockets = listening_sockets(pids)
    assert len(sockets) >= 3 and all(_loopback(ip) for ip, _ in sockets), sockets  # master, 2 workers (+ UIs)


def _loopback(ip: str) -> bool:
    import ipaddress

    a = ipaddress.ip_address(ip)
    return (getattr(a, "ipv4_mapped", None) or a).is_loopback


# ---------------------------------------------------------------------------------------- training
def _keys(uri: str) -> list[str]:
    from pipeline import fs

    loc = fs.location(uri)
    return sorted(f.path[len(loc.path) + 1:] for f in fs.list_files(loc))


def _error_lines(r) -> list[str]:
    """The driver's error lines (spark-submit copies the Python driver's stderr to its stdout)."""
    return [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("error:")]


def _why(r, cluster) -> str:
    """What to show when a driver failed: its error line, its stderr's tail, the executors' logs."""
    return "\n".join(_error_lines(r)) + "\n" + r.stdout[-3000:] + "\n" + r.stderr[-2000:] + "\n" + cluster.executor_logs()


@pytest.fixture(scope="module")
def digit_shards_s3(spark, s3, digits_dataset):
    """The sklearn digits in 2 disjoint worker shards on the store (written by the local session)."""
    from pipeline.shards.materialize import ShardConfig, shard
    from servers import environment

    uri = f"s3://{s3.bucket}/digits/shards"
    with environment(**s3.env("writer")):
        shard(ShardConfig(input=str(digits_dataset), output=uri, scheme="disjoint", workers=2, seed=0,
                          row_group_rows=64), spark)
    return f"{uri}/manifest.json"


_TRAIN = ("--epochs", "1", "--batch_size", "16", "--max_steps", "8", "--checkpoint_every", "4", "--seed", "7",
          "--progress", "false")


@pytest.mark.timeout(1200)
def test_training_ranks_write_their_outputs_to_the_store_from_the_workers(cluster, s3, digit_shards_s3, tmp_path):
    """Rank 0 runs on a worker that cannot see the driver's disk: its metrics and model reach the
    store directly and the driver commits them; both ranks' checkpoints are there too. The model
    equals the same run's in this process (``inprocess_reference``)."""
    import torch

    from pipeline import fs
    from pipeline.train.config import TrainConfig
    from servers import environment
    from train_fixtures import inprocess_reference

    b = f"s3://{s3.bucket}/train-cluster"
    r = cluster.submit(str(REPO / "jobs" / "train.py"), "--manifest", digit_shards_s3, "--output", f"{b}/run",
                       "--launcher", "torch", *_TRAIN, env=cluster.driver_env(**s3.env("writer")), cwd=tmp_path)
    assert r.returncode == 0, _why(r, cluster)
    with environment(**s3.env("writer")):
        assert _keys(f"{b}/run") == ["_COMPLETE", "metrics.jsonl", "model.pt", "summary.json"]
        assert [k for k in _keys(b) if ".tmp-" in k] == []
        ck = _keys(f"{b}/run-checkpoints")
        assert {"step_00000008/rank_000.pt", "step_00000008/rank_001.pt", "step_00000008/meta.json"} <= set(ck)
        summary = json.loads(fs.read_bytes(fs.location(f"{b}/run/summary.json")))
        assert summary["workers"] == 2 and summary["steps"] == 8 and summary["launcher"] == "torch"
        metrics = [json.loads(x) for x in fs.read_bytes(fs.location(f"{b}/run/metrics.jsonl")).decode().splitlines()]
        assert metrics[-1]["split"] == "test" and metrics[-1]["accuracy"] == summary["test_accuracy"]
        model = torch.load(io.BytesIO(fs.read_bytes(fs.location(f"{b}/run/model.pt"))), weights_only=True)["model"]
        ref = inprocess_reference(TrainConfig(manifest=digit_shards_s3, output=str(tmp_path / "ref"),
                                              **{k.lstrip("-"): v for k, v in zip(_TRAIN[::2], _TRAIN[1::2])}))
    local = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)["model"]
    assert ref["steps"] == 8
    for k, v in local.items():
        assert torch.allclose(v, model[k], atol=1e-6), k


@pytest.mark.timeout(1200)
def test_a_local_output_written_on_a_worker_is_refused_and_nothing_is_committed(cluster, s3, digit_shards_s3,
                                                                                 tmp_path):
    """The same run with a local output: rank 0 writes it on its own disk, which the driver cannot
    see; one line, exit 2, no output on the driver."""
    out = tmp_path / "out"
    r = cluster.submit(str(REPO / "jobs" / "train.py"), "--manifest", digit_shards_s3, "--output", str(out),
                       "--checkpoint_dir", f"s3://{s3.bucket}/train-local-ck", "--launcher", "torch", *_TRAIN,
                       "--max_steps", "2", env=cluster.driver_env(**s3.env("writer")), cwd=tmp_path)
    err = _error_lines(r)
    assert r.returncode == 2 and len(err) == 1, _why(r, cluster)
    assert str(out) in err[0] and "does not share this path" in err[0], err[0]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


# ---------------------------------------------------------------------------------- the HEP pipeline
def _rows(uri) -> list[dict]:
    """Every row of the Parquet dataset at ``uri`` (local or ``s3://``), in sample_id order."""
    import pyarrow.dataset as pads

    from pipeline import fs

    loc = fs.location(str(uri))
    d = pads.dataset(loc.path, filesystem=loc.filesystem(), format="parquet", ignore_prefixes=[".", "_"])
    return d.to_table().sort_by("sample_id").to_pylist()


def _count(uri) -> int:
    import pyarrow.dataset as pads

    from pipeline import fs

    loc = fs.location(str(uri))
    return pads.dataset(loc.path, filesystem=loc.filesystem(), format="parquet",
                        ignore_prefixes=[".", "_"]).count_rows()


def _same(a, b, rel: float = 1e-12) -> bool:
    """Equal JSON documents, numbers up to rounding (sums taken in another order)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k], rel) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return a == pytest.approx(b, rel=rel, abs=1e-12)
    return a == b


_HEP = {"events_per_class": 150, "real_samples": False, "seed": 11, "simulate.events_per_file": 75,
        "simulate.progress": False, "train.epochs": 2, "train.progress": False}


@pytest.mark.timeout(2700)
def test_the_hep_pipeline_on_the_cluster_equals_the_local_run(cluster, s3, spark, tmp_path):
    """jobs/run_hep.py end to end with output_root=s3://... on the cluster (Horovod-on-Spark
    training): the same events, ingested rows, HLF rows (values, labels, split) and scaling as the
    same run on local[2], and a test accuracy within 1 pp."""
    from pipeline import fs
    from pipeline.config import load_config
    from pipeline.workflows import HepRunConfig, run_hep
    from servers import environment

    overrides = [f"{k}={json.dumps(v)}" for k, v in _HEP.items()]
    local = tmp_path / "hep-local"
    want = run_hep(load_config(HepRunConfig, REPO / "configs" / "run_hep.yaml",
                               overrides + [f"output_root={local}", "train.launcher=inprocess"]), spark)
    uri = f"s3://{s3.bucket}/hep"
    sets = [x for o in overrides + [f"output_root={uri}"] for x in ("--set", o)]
    r = cluster.submit(str(REPO / "jobs" / "run_hep.py"), "--config", str(REPO / "configs" / "run_hep.yaml"), *sets,
                       env=cluster.driver_env(**s3.env("writer")), cwd=tmp_path, timeout=2400)
    assert r.returncode == 0, _why(r, cluster)
    with environment(**s3.env("writer")):
        got = json.loads(fs.read_bytes(fs.location(f"{uri}/summary.json")))
        assert got["events"] == want["events"] and sum(got["events"].values()) == 450
        assert _count(f"{uri}/events") == _count(local / "events") > 0
        hlf = _rows(f"{uri}/features/hlf")
        assert hlf == _rows(local / "features" / "hlf") and len(hlf) > 0
        assert {row["split"] for row in hlf} == {"train", "val", "test"}
        assert _count(f"{uri}/features/llf") == _count(local / "features" / "llf")
        scaling = json.loads(fs.read_bytes(fs.location(f"{uri}/features/scaling.json")))
        assert _same(scaling, json.loads((local / "features" / "scaling.json").read_text())), scaling
        assert abs(got["test_accuracy"] - want["test_accuracy"]) <= 0.01, (got["test_accuracy"], want["test_accuracy"])
        assert got["train_summary"]["launcher"] == "horovod" and got["train_summary"]["workers"] == 2
        leftovers = [k for k in _keys(f"s3://{s3.bucket}/hep") if ".tmp-" in k or "/." in "/" + k]
        assert leftovers == []


# ------------------------------------------------------------------------------ studies and tuning
@pytest.mark.timeout(2400)
def test_a_tuning_run_and_a_study_on_the_cluster_publish_to_the_store(cluster, s3, tmp_path):
    """A search with 2 trials run 2 at a time and a study of 2 runs, both with an s3:// output,
    driven by spark-submit on the cluster: every trial and run is committed on the store."""
    import pandas as pd

    from pipeline import fs
    from servers import environment
    from test_studies import tiny_study, write_yaml
    from test_tune import tiny_tune

    env = cluster.driver_env(**s3.env("writer"))
    data = f"s3://{s3.bucket}/studies-data"        # the cache of datasets and shards: where every node reaches
    tune_uri = f"s3://{s3.bucket}/tune/tiny"
    cfg = write_yaml(tmp_path / "tune.yaml", tiny_tune(tmp_path, output=tune_uri, data_dir=data,
                                                       tracking={"enabled": False}))
    r = cluster.submit(str(REPO / "jobs" / "tune.py"), "--config", str(cfg), env=env, cwd=tmp_path, timeout=1800)
    assert r.returncode == 0, _why(r, cluster)
    study_uri = f"s3://{s3.bucket}/studies/tiny"
    cfg = write_yaml(tmp_path / "study.yaml", tiny_study(tmp_path, name="tiny_cluster", seeds=1, output=study_uri,
                                                         data_dir=data, tracking={"enabled": False}))
    r = cluster.submit(str(REPO / "jobs" / "experiment.py"), "--config", str(cfg), env=env, cwd=tmp_path, timeout=1800)
    assert r.returncode == 0, _why(r, cluster)
    with environment(**s3.env("writer")):
        keys = set(_keys(tune_uri))
        assert {"optuna.journal", "trials.parquet", "best.json", "best_train.yaml"} <= keys, sorted(keys)
        for t in ("trials/trial_0", "trials/trial_1"):     # each trial's training, committed from its task
            assert {f"{t}/train/_COMPLETE", f"{t}/train/summary.json", f"{t}/train/model.pt"} <= keys, sorted(keys)
        trials = pd.read_parquet(io.BytesIO(fs.read_bytes(fs.location(f"{tune_uri}/trials.parquet"))))
        assert sorted(trials["trial"]) == [0, 1] and set(trials["state"]) == {"COMPLETE"}
        keys = set(_keys(study_uri))
        runs = sorted({k[:-len("/train/_COMPLETE")] for k in keys if k.endswith("/train/_COMPLETE")})
        assert len(runs) == 2 and all({f"{run}/run.json", f"{run}/train/model.pt"} <= keys for run in runs), sorted(keys)
        assert {"results.parquet", "report.md", "study.json"} <= keys
        results = pd.read_parquet(io.BytesIO(fs.read_bytes(fs.location(f"{study_uri}/results.parquet"))))
        assert len(results) == 2 and results["test_accuracy"].notna().all()
        assert [k for k in _keys(f"s3://{s3.bucket}") if k.startswith(("tune/", "studies")) and "/." in "/" + k] == []
    # the driver's working directory holds no trial or run output: they ran where the tasks ran
    assert not list(tmp_path.rglob("model.pt"))


# ------------------------------------------------------------------- the feature stage and a lost node
_CLASSES = ("ttbar", "wjets")
_SAMPLES = [{"name": n, "label": i + 1, "files": [f"{n}_*.root"]} for i, n in enumerate(_CLASSES)]
_FEATURES = {"samples": _SAMPLES, "step_size": 10, "test_fraction": 0.2, "val_fraction": 0.2, "seed": 3}


@pytest.fixture(scope="module")
def delphes_export(delphes_root, tmp_path_factory) -> Path:
    """Delphes-layout ttbar / W+jets files (the boosted events of the real delphes.root, each file
    in another order), 2 per class: 12 feature tasks of at most 10 events."""
    import hep_root_fixtures as H

    import numpy as np

    d = tmp_path_factory.mktemp("delphes-export")
    colls = H.boosted(H.read_required(delphes_root))          # the 25 events of delphes.root
    n = len(colls["Muon"])
    for c, name in enumerate(_CLASSES):
        for k in range(2):
            order = np.random.default_rng(10 * c + k).permutation(n)
            H.write_delphes_like(d / f"{name}_{k:04d}.root", H.take(colls, order))
    return d


@pytest.fixture(scope="module")
def xrd(delphes_export, tmp_path_factory):
    from servers import xrootd_server

    with xrootd_server(delphes_export, tmp_path_factory.mktemp("xrootd-log")) as server:
        yield server


@pytest.fixture(scope="module")
def local_features(spark, delphes_export, tmp_path_factory) -> Path:
    """The same feature stage on local[2] from the local files: what the cluster's output must equal."""
    from pipeline.features.stage import FeaturesConfig, build_features

    out = tmp_path_factory.mktemp("features-local") / "features"
    build_features(FeaturesConfig(input=str(delphes_export / "*.root"), output=str(out), **_FEATURES), spark=spark)
    return out


def _features_args(input_url: str, output: str, **extra) -> list[str]:
    values = {**_FEATURES, "input": input_url, "output": output, **extra}
    return [x for k, v in values.items() for x in ("--set", f"{k}={json.dumps(v)}")]


# a features job whose driver also watches the scheduler and prints KILL once a stage of the feature
# stage's own code runs two tasks at once (one on each worker)
_WATCHED_FEATURES = r'''
import sys, threading, time

from jobs.features import main
from pipeline.config import SparkConfig
from pipeline.spark import get_spark

spark = get_spark(SparkConfig())


def watch():
    tracker = spark.sparkContext.statusTracker()
    while True:
        for sid in tracker.getActiveStageIds():
            info = tracker.getStageInfo(sid)
            if info is not None and "pipeline/features/" in info.name and info.numActiveTasks >= 2:
                print(f"KILL stage {sid} ({info.name}): {info.numActiveTasks} of {info.numTasks} tasks running",
                      flush=True)
                return
        time.sleep(0.02)


threading.Thread(target=watch, daemon=True).start()
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.timeout(1800)
def test_a_worker_killed_during_the_feature_stage_leaves_a_complete_correct_output(cluster, s3, xrd, local_features,
                                                                                   tmp_path):
    """The feature stage reads its ROOT files over XRootD and writes to the store; a worker (its
    JVMs and Python workers) is SIGKILLed while the stage's tasks run. Spark reruns the lost tasks
    on the other worker, and the committed output equals the local run's: no part missing, none
    twice, nothing left of the lost attempts."""
    import threading

    from pipeline import fs
    from servers import environment

    script = tmp_path / "watched_features.py"
    script.write_text(_WATCHED_FEATURES)
    uri = f"s3://{s3.bucket}/features-killed"
    log = open(tmp_path / "driver.log", "w")
    proc = cluster.popen(str(script), *_features_args(xrd.url(xrd.root) + "/*.root", uri),
                         env=cluster.driver_env(**s3.env("writer")), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=log, text=True)
    lines: list[str] = []
    killed = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("KILL") and not killed.is_set():
                cluster.kill_worker(1)
                killed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=1500)
        reader.join(timeout=30)
        log.close()
        stderr = (tmp_path / "driver.log").read_text()
        assert killed.is_set(), "".join(lines)[-3000:] + stderr[-3000:]
        assert rc == 0, "".join(lines)[-3000:] + stderr[-3000:] + cluster.executor_logs()
        assert "Lost executor" in stderr, stderr[-3000:]
        with environment(**s3.env("writer")):
            for name in ("hlf", "llf"):
                assert _rows(f"{uri}/{name}") == _rows(local_features / name), name
            scaling = json.loads(fs.read_bytes(fs.location(f"{uri}/scaling.json")))
            assert _same(scaling, json.loads((local_features / "scaling.json").read_text())), scaling
            keys = _keys(uri)
            marker = json.loads(fs.read_bytes(fs.location(f"{uri}/_COMPLETE")))
            assert sorted(marker["files"]) == sorted(k for k in keys if k != "_COMPLETE")
            assert [k for k in _keys(f"s3://{s3.bucket}") if k.startswith(".features-killed")] == []
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.start_worker(1)
        cluster.wait_workers(2)


# ----------------------------------------------------------------------------------------- bad input
@pytest.mark.timeout(1200)
def test_an_unreachable_input_on_the_cluster_is_one_line_and_nothing_is_written(cluster, s3, xrd, tmp_path):
    """An XRootD server the executors cannot reach. (A bad output target, a missing bucket or
    missing credentials, is refused on the driver before any task, as on local Spark:
    tests/test_storage_features_s3.py and tests/test_fs.py's bad targets; a task without S3
    settings is one line, see the isolation probe.)"""
    from pipeline.train.comm.ports import free_port
    from servers import environment

    dead_server = f"127.0.0.1:{free_port()}"       # nothing listens there
    dead = [f"root://{dead_server}/{xrd.served}/{n}_0000.root" for n in _CLASSES]
    output = f"s3://{s3.bucket}/bad-unreachable-xrootd/features"
    r = cluster.submit(str(REPO / "jobs" / "features.py"), *_features_args(dead, output, file_timeout_s=5),
                       env=cluster.driver_env(**s3.env("writer")), cwd=tmp_path, timeout=900)
    err = _error_lines(r)
    assert r.returncode != 0 and len(err) == 1, _why(r, cluster)
    assert dead_server in err[0] and "Traceback" not in err[0], err[0]
    with environment(**s3.env("writer")):
        assert [k for k in _keys(f"s3://{s3.bucket}") if k.startswith(("bad-unreachable-xrootd",
                                                                       ".bad-unreachable-xrootd"))] == []
    assert [p.name for p in tmp_path.iterdir()] == []
