"""The training stage end to end: Horovod-on-Spark on real digits, checkpoints/resume, bad input, CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from jobs.train import main as train_main
from pipeline.errors import BadInputError, ConfigError
from pipeline.train.config import DebugConfig, TrainConfig
from pipeline.train.comm.device import device_kind, pick_device, torch_backend
from pipeline.train.comm.local import LocalCommunicator
from pipeline.train.launch import make_plan, train
from pipeline.train.metrics import read_metrics
from pipeline.train.worker import Worker
from train_fixtures import write_digit_shards

pytest_plugins = ["train_fixtures"]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.needs_horovod
@pytest.mark.timeout(1800)
def test_two_worker_horovod_arsgd_on_real_digits(spark, digit_shards_2, tmp_path):
    out = tmp_path / "train"
    s = train(TrainConfig(manifest=str(digit_shards_2), output=str(out), launcher="horovod", epochs=3,
                          batch_size=32, debug={"record_param_digests": True}, checkpoint_every=10), spark)
    man = json.loads(digit_shards_2.read_text())
    spe = min(w["rows"] for w in man["workers"]) // 32
    assert s["steps"] == 3 * spe and s["workers"] == 2 and s["launcher"] == "horovod"
    r0, r1 = s["ranks"]
    assert len(r0["digests"]) == s["steps"] and r0["digests"] == r1["digests"]  # identical after EVERY step
    assert len(set(r0["digests"])) == s["steps"]  # and they did change every step
    assert s["samples_processed"] == 2 * s["steps"] * 32
    recs = read_metrics(str(out / "metrics.jsonl"))
    assert [r["split"] for r in recs][-1] == "test" and recs[-1]["accuracy"] == s["test_accuracy"]
    val = [r["loss"] for r in recs if r["split"] == "val"]
    assert len(val) >= 2 and val[-1] < val[0]  # validation loss fell: it learned
    for key in ("loss", "accuracy", "auc", "samples_per_s", "comm_fraction", "bytes_sent", "epoch"):
        assert key in recs[-1]
    assert recs[-1]["bytes_sent"] > 0 and 0 < recs[-1]["comm_fraction"] < 1
    assert set(recs[-1]["auc"]) == {str(c) for c in range(10)}
    assert json.loads((out / "summary.json").read_text())["test_accuracy"] == s["test_accuracy"]
    assert (out / "model.pt").is_file()
    ck = sorted(p.name for p in (tmp_path / "train-checkpoints").iterdir())
    assert ck[-1] == f"step_{s['steps']:08d}" and all(c.startswith("step_") for c in ck)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_resume_continues_like_an_uninterrupted_run(tmp_path):
    man = write_digit_shards(tmp_path / "shards", workers=2, n_train=256, n_test=64, n_val=64, row_group_rows=32)
    base = dict(manifest=str(man), launcher="local", epochs=2, batch_size=16, optimizer="sgd", lr=0.05,
                algorithm={"name": "local_sgd", "params": {"period": 3}}, checkpoint_every=5, progress=False,
                max_restarts=0)
    ref = train(TrainConfig(output=str(tmp_path / "ref"), **base))
    assert ref["steps"] == 16
    crashed = TrainConfig(output=str(tmp_path / "run"), debug={"fail_at_step": 12}, **base)
    with pytest.raises(Exception, match="fail_at_step=12|worker process died"):
        train(crashed)
    assert not (tmp_path / "run").exists()  # no partial output
    assert sorted(p.name for p in (tmp_path / "run-checkpoints").iterdir()) == ["step_00000005", "step_00000010"]
    resumed = train(crashed.model_copy(update={"debug": DebugConfig(), "resume": True}))
    assert resumed["final_digests"] == ref["final_digests"]
    assert resumed["test_accuracy"] == ref["test_accuracy"]
    a = read_metrics(str(tmp_path / "ref" / "metrics.jsonl"))
    b = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [(r["step"], r["accuracy"], r["loss"]) for r in a] == [(r["step"], r["accuracy"], r["loss"]) for r in b]
    # a resume under a changed config is refused, naming the value
    with pytest.raises(ConfigError, match="lr=0.1"):
        train(crashed.model_copy(update={"debug": DebugConfig(), "resume": True, "lr": 0.1}))


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("bad") / "shards", workers=2, n_train=128, n_test=32, n_val=32)


def _run_cli(args, capsys):
    rc = train_main(args)
    return rc, capsys.readouterr().err.strip().splitlines()


def test_bad_inputs_give_one_line_and_no_output(tmp_path, small_shards, capsys):
    out = tmp_path / "out"
    rc, err = _run_cli(["--manifest", str(tmp_path / "in" / "missing.json"), "--output", str(out)], capsys)
    assert rc == 2 and err[-1].startswith("error: shard manifest not found") and "missing.json" in err[-1]
    rc, err = _run_cli(["--manifest", str(small_shards), "--output", str(out), "--epochs", "-1"], capsys)
    assert rc == 2 and "epochs=-1" in err[-1]
    rc, err = _run_cli(["--manifest", str(small_shards), "--output", str(out), "--batch_size", "1000"], capsys)
    assert rc == 2 and "batch_size=1000" in err[-1]
    rc, err = _run_cli(["--manifest", str(small_shards), "--output", str(out), "--workers", "3"], capsys)
    assert rc == 2 and "workers=3" in err[-1]
    rc, err = _run_cli(["--manifest", str(small_shards), "--output", str(out), "--model", "hlf"], capsys)
    assert rc == 2 and "column 'hlf' missing" in err[-1]
    rc, err = _run_cli(["--manifest", str(small_shards), "--output", str(out),
                        "--set", "algorithm.name=sgdx"], capsys)
    assert rc == 2 and "sgdx" in err[-1]
    assert not out.exists()


def test_missing_column_in_a_shard_is_named(tmp_path):
    import pyarrow.parquet as pq

    man = write_digit_shards(tmp_path / "shards", workers=2, n_train=128, n_test=32, n_val=32)
    f = tmp_path / "shards" / "worker_001" / "part-00000.parquet"
    pq.write_table(pq.read_table(f).drop(["image"]), f)
    with pytest.raises(BadInputError, match=r"worker_001/part-00000.parquet: column 'image' missing"):
        train(TrainConfig(manifest=str(man), output=str(tmp_path / "o"), launcher="local"))
    assert not (tmp_path / "o").exists()


def test_single_class_data_is_one_line_naming_the_manifest(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    man = write_digit_shards(tmp_path / "shards", workers=2, n_train=128, n_test=32, n_val=32)
    for f in (tmp_path / "shards").rglob("*.parquet"):
        t = pq.read_table(f)
        pq.write_table(t.set_column(t.schema.get_field_index("label"), "label",
                                    pa.array([0] * t.num_rows, pa.int64())), f)
    with pytest.raises(BadInputError, match=r"manifest.json: the shards and eval splits hold 1 class label"):
        make_plan(TrainConfig(manifest=str(man), output=str(tmp_path / "o"), launcher="local"))


@pytest.mark.needs_horovod                 # the default launcher
def test_dry_run_prints_the_plan(small_shards, capsys):
    assert train_main(["--manifest", str(small_shards), "--dry-run", "--epochs", "4", "--batch_size", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = out["plan"]
    assert p["workers"] == 2 and p["steps_per_epoch"] == 4 and p["total_steps"] == 16
    assert p["eval_every"] == 4  # ceil(N / B_global) = ceil(128 / 32)


def test_help_lists_the_options():
    r = subprocess.run([sys.executable, "-m", "jobs.train", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--launcher" in r.stdout and "--algorithm.name" in r.stdout
    assert "--debug.fail_at_step" in r.stdout


def test_help_lists_every_registered_algorithm():
    from pipeline.train.algorithms import REGISTRY

    r = subprocess.run([sys.executable, "-m", "jobs.train", "--help"], capture_output=True, text=True)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and all(name in text for name in REGISTRY), text


@pytest.mark.parametrize("requested,cuda,assigned,local_rank,count,want", [
    ("auto", False, None, 0, 0, "cpu"),
    ("cpu", True, 1, 0, 2, "cpu"),           # device=cpu on a GPU host stays on the CPU
    ("auto", True, None, 3, 2, "cuda:1"),    # no Spark assignment: local rank modulo the devices
    ("auto", True, 1, 0, 2, "cuda:1"),       # the GPU Spark assigned to the task wins
    ("cuda", True, 0, 1, 2, "cuda:0"),
])
def test_device_resolution(requested, cuda, assigned, local_rank, count, want):
    dev = pick_device(requested, cuda_available=cuda, local_rank=local_rank, device_count=count, assigned_gpu=assigned)
    assert str(dev) == want


def test_device_errors_and_backend_follows_the_device():
    with pytest.raises(ConfigError, match="device='cuda'"):
        pick_device("cuda", cuda_available=False)
    with pytest.raises(ConfigError, match="assigned GPU 3"):
        pick_device("auto", cuda_available=True, device_count=2, assigned_gpu=3)
    assert torch_backend(device_kind("cpu", cuda_available=True)) == "gloo"
    assert torch_backend(device_kind("auto", cuda_available=True)) == "nccl"
    assert torch_backend(device_kind("auto", cuda_available=False)) == "gloo"


def test_the_torch_launcher_on_cuda_without_a_gpu_per_task_is_one_line_before_any_work(spark, tmp_path):
    """TorchDistributor on CUDA needs spark.task.resource.gpu.amount (a whole GPU per task): one
    ConfigError naming it, not TorchDistributor's RuntimeError restarted as a lost worker."""
    man = write_digit_shards(tmp_path / "s", workers=2, n_train=64, n_test=16, n_val=16, row_group_rows=16)
    with pytest.raises(ConfigError, match=r"spark\.task\.resource\.gpu\.amount=None: launcher=torch with device=cuda"):
        train(TrainConfig(manifest=str(man), output=str(tmp_path / "o"), launcher="torch", device="cuda",
                          batch_size=8, progress=False), spark)
    assert not (tmp_path / "o").exists()


def test_torch_communicator_for_cpu_tensors_is_gloo():
    from decentral_fixtures import run_torch_workers, torch_backend_in_use

    assert run_torch_workers(torch_backend_in_use, 1, "cpu") == ["gloo"]


def _easgd_worker(tmp_path, evaluate: str) -> Worker:
    man = write_digit_shards(tmp_path / "shards", workers=1, n_train=96, n_test=32, n_val=32, row_group_rows=32)
    cfg = TrainConfig(manifest=str(man), output=str(tmp_path / "o"), launcher="local", epochs=1, batch_size=16,
                      optimizer="sgd", lr=0.05, progress=False,
                      algorithm={"name": "easgd", "params": {"tau": 2, "alpha": 0.3, "evaluate": evaluate}})
    out = tmp_path / "out"
    out.mkdir()
    plan = {**make_plan(cfg), "resume_from": None}
    return Worker(cfg, LocalCommunicator(), plan, str(out), str(tmp_path / "ck"), torch.device("cpu"))


@pytest.mark.parametrize("evaluate", ["average", "center"])
def test_easgd_evaluates_the_configured_model(tmp_path, evaluate):
    w = _easgd_worker(tmp_path, evaluate)
    w.start(resume=False)
    with w.batches(0, limit=4) as batches:
        for inputs, y in batches:
            w.train_step(inputs, y, lr_step=w.step)
    assert w.step == 4
    own = [p.detach().clone() for p in w.model.parameters()]
    centre = w.algo.centre_tensors()[:len(own)]
    assert all(not torch.allclose(a, c) for a, c in zip(own, centre))  # the elastic steps kept them apart
    with w.evaluation_weights():
        inside = [p.detach().clone() for p in w.model.parameters()]
    for got, want in zip(inside, centre if evaluate == "center" else own):  # world 1: the average is own
        assert torch.equal(got, want)
    assert all(torch.equal(a, p) for a, p in zip(own, w.model.parameters()))  # restored after evaluation
    s = w.finish(log_val=False)
    final = list(w.model.parameters())
    for got, want in zip(final, centre if evaluate == "center" else own):  # the final model follows the choice
        assert torch.equal(got, want)
    if evaluate == "average":
        assert 0.0 <= s["centre_test_accuracy"] <= 1.0
    else:
        assert "centre_test_accuracy" not in s


def test_report_plots_learning_curves(tmp_path):
    from pipeline.report.curves import ReportConfig, report

    runs = []
    for name, accs in (("a", [0.5, 0.8, 0.9]), ("b", [0.3, 0.6, 0.85])):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"split": "val", "step": i, "epoch": i, "wall_s": i * 2.0,
                                                             "accuracy": a}) + "\n" for i, a in enumerate(accs, 1)))
        runs.append(str(d))
    r = report(ReportConfig(runs=runs, output=str(tmp_path / "c.png")))
    png = (tmp_path / "c.png").read_bytes()
    assert r["runs"] == 2 and png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    with pytest.raises(BadInputError, match="metrics file not found"):
        report(ReportConfig(runs=[str(tmp_path / "zzz")], output=str(tmp_path / "d.png")))
