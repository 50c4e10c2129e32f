"""A lost worker does not end the run: the training stage relaunches the workers from the newest
complete checkpoint (local launcher here; Horovod-on-Spark and TorchDistributor in
test_restart_cluster.py), the killed-and-resumed run ends bit-identical to the uninterrupted
one for the deterministic algorithms, an Airflow retry of the train task resumes, and after the
last allowed failure the job ends with one line. Also: the GPU a Spark task uses and
TorchDistributor's use_gpu come from the task's resources and the config."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pipeline.errors import BadInputError, ConfigError
from pipeline.train import restart
from pipeline.train.config import TrainConfig
from pipeline.train.gpus import task_gpu, torch_use_gpu

pytest_plugins = ["train_fixtures"]


# ---------------------------------------------------------------------------- GPU placement (CPU host)
class _Resource:
    def __init__(self, addresses):
        self.name, self.addresses = "gpu", addresses


def test_a_spark_task_uses_the_gpu_spark_assigned_to_it():
    assert task_gpu({"gpu": _Resource(["3"])}) == 3
    assert task_gpu({"gpu": _Resource(["1", "2"])}) == 1
    assert task_gpu({"gpu": ["5"]}) == 5  # what horovod.spark's task_info holds on some versions
    assert task_gpu({}) is None and task_gpu({"gpu": _Resource([])}) is None
    assert task_gpu() is None  # outside a Spark task: no assignment


def test_torchdistributor_use_gpu_comes_from_the_config_not_the_driver():
    gpu_tasks = {"spark.task.resource.gpu.amount": "1"}
    assert torch_use_gpu("cuda", False, {}) is True
    assert torch_use_gpu("cpu", False, gpu_tasks) is False
    assert torch_use_gpu("auto", False, gpu_tasks) is True
    assert torch_use_gpu("auto", False, {}) is False
    assert torch_use_gpu("auto", True, gpu_tasks) is False  # local mode: the driver's GPUs count
    assert torch_use_gpu("auto", True, {"spark.driver.resource.gpu.amount": "2"}) is True


def test_torchdistributor_on_cuda_must_give_every_worker_a_gpu_of_its_own():
    from pipeline.train.gpus import check_torch_gpus

    check_torch_gpus(2, True, {"spark.driver.resource.gpu.amount": "2"})
    check_torch_gpus(4, False, {"spark.task.resource.gpu.amount": "1"})
    for world, local, conf, named in [
            (2, True, {"spark.driver.resource.gpu.amount": "1"}, "spark.driver.resource.gpu.amount='1'"),
            (2, True, {}, "spark.driver.resource.gpu.amount=None"),
            (2, False, {}, "spark.task.resource.gpu.amount=None"),
            (2, False, {"spark.task.resource.gpu.amount": "0.5"}, "spark.task.resource.gpu.amount='0.5'"),
            # a whole number above 1 would hang: TorchDistributor starts ceil(world/amount) tasks, each
            # told --nnodes=world, so the rendezvous never fills
            (2, False, {"spark.task.resource.gpu.amount": "2"}, "spark.task.resource.gpu.amount='2'"),
            (4, False, {"spark.task.resource.gpu.amount": "4"}, "spark.task.resource.gpu.amount='4'"),
            (2, False, {"spark.task.resource.gpu.amount": "x"}, "spark.task.resource.gpu.amount='x'")]:
        with pytest.raises(ConfigError) as e:
            check_torch_gpus(world, local, conf)
        assert named in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- the supervisor alone
def _cfg(tmp_path, **kw):
    return TrainConfig(manifest="m.json", output=str(tmp_path / "out"), **kw)


def test_supervisor_restarts_up_to_max_restarts_then_one_line(tmp_path, caplog):
    cfg = _cfg(tmp_path, max_restarts=2, debug={"fail_at_step": 3})
    calls = []

    def launch(c, resume_from):
        calls.append((c.debug.fail_at_step, resume_from))
        raise restart.WorkerLost("rank 1: worker process died (killed by SIGKILL)", rank=1)

    with caplog.at_level(logging.WARNING), pytest.raises(restart.TrainingFailed) as e:
        restart.supervise(launch, cfg, tmp_path / "ck", {}, None)
    msg = str(e.value)
    assert "\n" not in msg and "after 2 restart(s)" in msg and "killed by SIGKILL" in msg
    assert "no checkpoint" in msg and e.value.exit_code == 1
    assert calls == [(3, None), (None, None), (None, None)]  # the injected fault only on the first launch
    assert sum("restart" in r.getMessage() for r in caplog.records) == 2


def test_supervisor_does_not_restart_bad_input(tmp_path):
    calls = []

    def launch(c, resume_from):
        calls.append(1)
        raise BadInputError("/x/part-0.parquet: column 'label' has type string")

    with pytest.raises(BadInputError):
        restart.supervise(launch, _cfg(tmp_path), tmp_path / "ck", {}, None)
    assert calls == [1]


@pytest.mark.parametrize("exc", [TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"),
                                 NameError("name 'x' is not defined"),
                                 ImportError("cannot import name 'foo' from 'bar'"),
                                 RuntimeError("rank 0: TypeError: bad; rank 1: TypeError: bad"),
                                 RuntimeError("Horovod job failed: ... TypeError: 'NoneType' object is not callable")])
def test_an_error_in_the_code_is_not_restarted(tmp_path, exc, caplog):
    calls = []

    def launch(c, resume_from):
        calls.append(1)
        raise exc

    with caplog.at_level(logging.WARNING), pytest.raises(restart.TrainingFailed) as e:
        restart.supervise(launch, _cfg(tmp_path, max_restarts=3), tmp_path / "ck", {}, None)
    assert calls == [1] and not any("restart" in r.getMessage() for r in caplog.records)
    msg = str(e.value)
    assert "\n" not in msg and "not restarted" in msg and e.value.exit_code == 1, msg


@pytest.mark.parametrize("launcher,exc,hint", [
    ("horovod", ModuleNotFoundError("No module named 'horovod'", name="horovod"), "scripts/build_horovod.sh"),
    ("torch", ModuleNotFoundError("No module named 'pyspark.ml.torch'", name="pyspark.ml.torch"), "pip install"),
    ("horovod", RuntimeError("Exception in task: ModuleNotFoundError: No module named 'horovod'"), "build_horovod")])
def test_a_missing_module_fails_at_once_naming_what_to_install_or_which_launcher(tmp_path, launcher, exc, hint):
    from pipeline.errors import ConfigError

    calls = []

    def launch(c, resume_from):
        calls.append(1)
        raise exc

    with pytest.raises(ConfigError) as e:
        restart.supervise(launch, _cfg(tmp_path, launcher=launcher, max_restarts=3), tmp_path / "ck", {}, None)
    msg = str(e.value)
    assert calls == [1] and "\n" not in msg and hint in msg and "launcher=" in msg, msg


def test_transient_failures_are_still_restarted(tmp_path):
    for exc in (restart.WorkerLost("rank 1: worker process died (killed by SIGKILL); then rank 0: TypeError: x", 1),
                RuntimeError("Connection reset by peer"), OSError("Connection refused")):
        assert restart.is_restartable(exc), exc


def test_a_checkpoint_dir_overlapping_the_output_is_refused(tmp_path):
    from pipeline.errors import ConfigError
    from pipeline.train.launch import check_targets

    out = tmp_path / "out"
    for ck in (out, out / "ck", tmp_path):
        with pytest.raises(ConfigError, match="overlaps the output"):
            check_targets(_cfg(tmp_path, checkpoint_dir=str(ck)))
    assert check_targets(_cfg(tmp_path, checkpoint_dir=str(tmp_path / "out2")))[1].name == "out2"
    assert check_targets(_cfg(tmp_path))[1].name == "out-checkpoints"


def test_inexact_algorithms_are_named():
    assert restart.resumes_exactly(TrainConfig(algorithm={"name": "local_sgd", "params": {"period": 4}}))
    assert restart.resumes_exactly(TrainConfig(algorithm={"name": "slowmo"}))
    assert not restart.resumes_exactly(TrainConfig(algorithm={"name": "timed_local_sgd",
                                                              "params": {"round_seconds": 0.5}}))


def test_restart_records_land_at_their_step_in_metrics(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"kind": "eval", "split": "val", "step": s}) + "\n" for s in (5, 10, 15, 20)))
    restart.record_restarts(m, [{"kind": "restart", "restart": 1, "from_step": 10}])
    steps = [(r["kind"], r.get("step", r.get("from_step"))) for r in map(json.loads, m.read_text().splitlines())]
    assert steps == [("eval", 5), ("eval", 10), ("restart", 10), ("eval", 15), ("eval", 20)]


# ---------------------------------------------------------------------------- real runs, local launcher
def _shards(tmp_path, workers=2):
    from train_fixtures import write_digit_shards

    return write_digit_shards(tmp_path / "shards", workers=workers, n_train=128 * workers, n_test=64, n_val=32,
                              row_group_rows=32)


def _base(man, **kw):
    d = dict(manifest=str(man), launcher="local", epochs=2, batch_size=16, optimizer="sgd", lr=0.05,
             checkpoint_every=5, progress=False)
    d.update(kw)
    return d


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


ALGORITHMS = {"arsgd": {"name": "arsgd"}, "local_sgd": {"name": "local_sgd", "params": {"period": 3}},
              "slowmo": {"name": "slowmo", "params": {"base": "local_sgd", "base_params": {"period": 2}, "tau": 4}}}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_a_killed_worker_is_relaunched_and_the_run_ends_bit_identical(tmp_path, algo):
    from pipeline.train.launch import train

    man = _shards(tmp_path)
    base = _base(man, algorithm=ALGORITHMS[algo])
    from train_fixtures import inprocess_reference

    ref = inprocess_reference(TrainConfig(output=str(tmp_path / "ref"), **base))   # the uninterrupted run
    assert ref["steps"] == 16 and ref["restarts"] == []
    run = train(TrainConfig(output=str(tmp_path / "run"), debug={"fail_at_step": 12, "fail_rank": 1,
                                                                 "fail_mode": "kill"}, **base))
    assert run["final_digests"] == ref["final_digests"]  # bit-identical parameters on every rank
    assert run["test_accuracy"] == ref["test_accuracy"] and run["test_loss"] == ref["test_loss"]
    (r,) = run["restarts"]
    assert r["worker"] == 1 and r["from_step"] == 10 and r["bit_identical"] is True
    assert "SIGKILL" in r["failure"] and r["checkpoint"].endswith("step_00000010")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["restarts"] == [r]
    recs = _read(tmp_path / "run" / "metrics.jsonl")
    kinds = [(m["kind"], m.get("step", m.get("from_step"))) for m in recs]
    assert ("restart", 10) in kinds
    evals = [(m["step"], m["accuracy"], m["loss"]) for m in recs if m["kind"] != "restart"]
    assert evals == [(m["step"], m["accuracy"], m["loss"]) for m in _read(tmp_path / "ref" / "metrics.jsonl")]
    ck = tmp_path / "run-checkpoints"
    assert sorted(p.name for p in (ck / "step_00000016").iterdir()) == ["meta.json", "rank_000.pt", "rank_001.pt"]
    assert len(list(ck.iterdir())) <= 3  # keep_checkpoints default


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_after_the_last_allowed_failure_one_line_names_the_failure_and_the_checkpoint(tmp_path, capsys):
    from jobs.train import main

    man = _shards(tmp_path)
    out = tmp_path / "out"
    rc = main(["--manifest", str(man), "--output", str(out), "--launcher", "local", "--epochs", "2",
               "--batch_size", "16", "--checkpoint_every", "5", "--progress", "false", "--max_restarts", "0",
               "--set", "debug.fail_at_step=7", "--set", "debug.fail_rank=0", "--set", "debug.fail_mode=kill"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert rc == 1 and len(err) == 1
    assert "worker process died (killed by SIGKILL)" in err[0] and "step_00000005" in err[0], err[0]
    assert "resume=true" in err[0]
    assert not out.exists()  # nothing partial
    # a plain rerun does not delete that checkpoint: one line naming it and how to resume or start over
    ck = tmp_path / "out-checkpoints"
    before = {p.name for p in ck.iterdir()}
    rc = main(["--manifest", str(man), "--output", str(out), "--launcher", "local", "--epochs", "2",
               "--batch_size", "16", "--checkpoint_every", "5", "--progress", "false"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(err) == 1 and "step_00000005" in err[0] and "fresh_start=true" in err[0], err
    assert {p.name for p in ck.iterdir()} == before and (ck / "step_00000005" / "meta.json").is_file()
    # ... and that checkpoint is what resume=true continues from
    rc = main(["--manifest", str(man), "--output", str(out), "--launcher", "local", "--epochs", "2",
               "--batch_size", "16", "--checkpoint_every", "5", "--progress", "false", "--resume", "true"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["resumed_from"].endswith("step_00000005") and s["steps"] == 16


def _files(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.timeout(600)
def test_a_checkpoint_dir_holding_the_shards_is_refused_and_every_file_kept(tmp_path, capsys):
    """``--set checkpoint_dir=<the shards>``: one line naming the directory, exit 2, no file touched."""
    from jobs.train import main

    man = _shards(tmp_path, workers=1)
    shards = man.parent
    before = _files(shards)
    rc = main(["--manifest", str(man), "--output", str(tmp_path / "out"), "--launcher", "local", "--epochs", "1",
               "--batch_size", "16", "--progress", "false", "--max_restarts", "0",
               "--set", f"checkpoint_dir={shards}"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(err) == 1 and f"checkpoint_dir {shards} holds" in err[0], err
    assert _files(shards) == before
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(600)
def test_horovod_not_installed_fails_at_once_with_one_line(tmp_path, repo):
    """A real failing import: ``horovod`` blocked in the job's interpreter (``sys.modules`` entry
    None, what Python does for a module that must not be imported) with the default launcher."""
    import subprocess
    import sys

    man = _shards(tmp_path, workers=1)
    code = ("import sys; sys.modules['horovod'] = None\n"
            "from jobs.train import main\n"
            f"sys.exit(main(['--manifest', {str(man)!r}, '--output', {str(tmp_path / 'out')!r}, '--epochs', '1',"
            "'--progress', 'false', '--launcher', 'horovod']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=500)
    err = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-3000:]
    assert "horovod" in err[0] and "build_horovod.sh" in err[0] and "launcher=torch" in err[0], err[0]
    assert "restart" not in p.stderr.replace(err[0], "")  # no relaunch was tried
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_type_error_inside_a_worker_ends_the_run_at_once(tmp_path, capsys):
    from jobs.train import main

    man = _shards(tmp_path)
    rc = main(["--manifest", str(man), "--output", str(tmp_path / "out"), "--launcher", "local", "--epochs", "1",
               "--batch_size", "16", "--checkpoint_every", "2", "--progress", "false", "--max_restarts", "2",
               "--set", "debug.fail_at_step=3", "--set", "debug.fail_rank=1", "--set", "debug.fail_mode=type_error"])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 1 and len(line) == 1 and "TypeError" in line[0] and "not restarted" in line[0], err[-3000:]
    assert "step_00000002" in line[0]  # where it can resume once the code is fixed
    assert "restart 1/2" not in err


def test_hang_is_accepted_for_local_workers_which_run_the_watchdog(tmp_path):
    """Local workers (M > 1) are processes with a watchdog, so ``fail_mode=hang`` is accepted for
    them; a single local worker runs inside the job's process, without one: refused at planning."""
    from pipeline.errors import ConfigError
    from pipeline.train.launch import make_plan

    hang = {"fail_at_step": 3, "fail_mode": "hang"}
    TrainConfig(launcher="local", debug=hang)
    with pytest.raises(ConfigError, match="stall_timeout"):
        TrainConfig(launcher="local", stall_timeout=0, debug=hang)
    man = _shards(tmp_path, workers=1)
    with pytest.raises(ConfigError, match="fail_mode='hang'.*one worker"):
        make_plan(TrainConfig(manifest=str(man), launcher="local", debug=hang))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_hung_local_worker_is_ended_by_its_watchdog_and_the_run_relaunched(tmp_path):
    from pipeline.train.launch import train

    man = _shards(tmp_path)
    run = train(TrainConfig(output=str(tmp_path / "run"), **_base(man, stall_timeout=20),
                            debug={"fail_at_step": 7, "fail_rank": 1, "fail_mode": "hang"}))
    (r,) = run["restarts"]
    assert "exit code 75" in r["failure"] and r["from_step"] == 5, r
    assert run["steps"] == 16


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_local_workers_end_when_their_launching_process_is_killed(tmp_path, sig):
    """The job's process killed while its local workers block (rank 1 hangs at step 3, rank 0 waits
    for it; the watchdog's stall_timeout far away): no worker outlives it by more than a few seconds
    (the workers are children of the fork server, not of the job, so nothing else would end them)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    man = _shards(tmp_path)
    cmd = [sys.executable, "-m", "jobs.train", "--manifest", str(man), "--output", str(tmp_path / "out"),
           "--launcher", "local", "--epochs", "1", "--batch_size", "16", "--progress", "false",
           "--stall_timeout", "600", "--set", "debug.fail_at_step=3", "--set", "debug.fail_rank=1",
           "--set", "debug.fail_mode=hang"]
    job = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    workers = []
    try:
        parent, deadline = psutil.Process(job.pid), time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline:   # the fork server's children: the ranks
            time.sleep(0.5)
            workers = [c for p in parent.children(recursive=True) if "forkserver" in " ".join(p.cmdline())
                       for c in p.children()]
        assert len(workers) == 2, [p.cmdline() for p in parent.children(recursive=True)]
        time.sleep(3)                                                  # both ranks inside the run
        assert all(w.is_running() for w in workers)
        os.kill(job.pid, getattr(signal, sig))
        job.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, [(w.pid, w.status()) for w in alive]
    finally:
        if job.poll() is None:
            job.kill()
        for w in workers:                                              # no leftovers when it fails
            if w.is_running():
                w.kill()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_airflow_retry_of_the_train_task_resumes_from_the_run_scoped_checkpoints(tmp_path, repo):
    """The DAG's train task command, run twice for the same run key: the first attempt dies, the
    retry (same command, same run-scoped paths) resumes from its checkpoints."""
    import subprocess
    import sys

    from pipeline.outputs import run_scoped

    man = _shards(tmp_path)
    out = run_scoped(tmp_path / "airflow", "scheduled__2026-01-01T000000", "train")
    cmd = [sys.executable, "jobs/train.py", "--set", f"manifest={man}", "--set", f"output={out}",
           "--set", "launcher=local", "--set", "epochs=2", "--set", "batch_size=16", "--set", "checkpoint_every=5",
           "--set", "progress=false", "--set", "resume=auto"]
    first = subprocess.run(cmd + ["--set", "max_restarts=0", "--set", "debug.fail_at_step=12"], cwd=repo,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 1, first.stderr[-2000:]
    assert (out.parent / "train-checkpoints" / "step_00000010" / "meta.json").is_file()
    retry = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert retry.returncode == 0, retry.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["resumed_from"].endswith("step_00000010") and s["steps"] == 16


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_time_budgeted_run_resumes_with_a_warning_that_it_is_not_bit_identical(tmp_path, caplog):
    from pipeline.train.launch import train

    man = _shards(tmp_path)
    cfg = TrainConfig(output=str(tmp_path / "run"), debug={"fail_at_step": 5, "fail_rank": 1, "fail_mode": "kill"},
                      **_base(man, checkpoint_every=4,
                              algorithm={"name": "timed_local_sgd", "params": {"round_seconds": 0.05,
                                                                              "nominal_steps": 2}}))
    with caplog.at_level(logging.WARNING):
        run = train(cfg)
    (r,) = run["restarts"]
    assert r["bit_identical"] is False and r["worker"] == 1
    assert any("not bit-identical" in m.getMessage() for m in caplog.records)
    assert run["steps"] > r["from_step"] and "test_accuracy" in run  # it went on from the checkpoint to the end
    assert "Connection reset" not in r["failure"]  # the root failure, not its consequence for the peers
