"""Hostile inputs other than ROOT files: a wrong type for every config key of every job, broken
YAML configs, broken manifests and scaling files, corrupted Parquet parts in the inputs of the
shard and train stages, an output directory that is not writable and a disk that fills during
the write. Each gives ONE line naming the file, column or key, a non-zero exit (2 for bad input
or config), no partial output, and leaves a previous output of the same path untouched.
Cases tried: see docs/failures.md."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import REQUIRED, build_config, config_fields
from pipeline.errors import ConfigError

pytest_plugins = ["train_fixtures"]

JOBS = {"train": "pipeline.train.config:TrainConfig", "shard": "pipeline.shards.materialize:ShardConfig",
        "ingest_images": "pipeline.ingest.images:ImagesIngestConfig",
        "ingest_root": "pipeline.ingest.root:IngestRootConfig", "features": "pipeline.features.stage:FeaturesConfig",
        "simulate": "pipeline.simulate.config:SimulateConfig", "report": "pipeline.report.curves:ReportConfig",
        "run_images": "pipeline.workflows:ImagesRunConfig", "run_hep": "pipeline.workflows:HepRunConfig"}
#: values for required keys, so that the key under test is the only wrong one
PLACEHOLDERS = {"input": "x.root", "samples": "[{name: a, label: 0, files: [x.root]}]", "runs": "[x]"}
#: wrong values tried in turn: the first one the key rejects is used
WRONG = ("{wrong: [1]}", "[1, 2]", "not-a-value-@@")


def _cls(spec: str):
    mod, name = spec.split(":")
    return getattr(importlib.import_module(mod), name)


def _required(cls) -> list[str]:
    out = []
    for key, default, _ in config_fields(cls):
        if default is REQUIRED:
            if key not in PLACEHOLDERS:
                pytest.fail(f"{cls.__name__}: no placeholder for required key {key!r}")
            out.append(f"{key}={PLACEHOLDERS[key]}")
    return out


def _cli(job: str, argv: list[str], capsys) -> tuple[int, list[str]]:
    main = importlib.import_module(f"jobs.{job}").main
    rc = main(argv)
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    return rc, err


def test_a_wrong_type_for_every_config_key_gives_one_line_naming_the_key(capsys):
    tried, accepts_anything = 0, []
    for job, spec in JOBS.items():
        cls = _cls(spec)
        base = _required(cls)
        for key, _, _ in config_fields(cls):
            if key in PLACEHOLDERS:
                continue
            wrong = None
            for value in WRONG:
                try:
                    build_config(cls, {}, base + [f"{key}={value}"])
                except ConfigError:
                    wrong = value
                    break
            if wrong is None:
                accepts_anything.append(f"{job}:{key}")
                continue
            rc, err = _cli(job, sum((["--set", s] for s in base + [f"{key}={wrong}"]), []) + ["--dry-run"], capsys)
            tried += 1
            assert rc == 2 and len(err) == 1, (job, key, err)
            # a nested model's own validator names the key from that model down (algorithm.params.x)
            assert key in err[0] or key.split(".", 1)[1] in err[0], (job, key, err[0])
    # only free-form keys take any value (algorithm parameters are checked by the algorithm)
    assert all(k.endswith(("algorithm.params", "spark.conf", ".base_params")) for k in accepts_anything), accepts_anything
    assert tried > 150
    print(f"config keys tried: {tried}")


@pytest.mark.parametrize("text", ["epochs: 3\nlr: [0.1,\n", "- a\n- b\n", "epochs: 3\n\tlr: 0.1\n", "\x00\x01binary"])
def test_broken_yaml_config_gives_one_line_naming_the_file(tmp_path, capsys, text):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(text)
    rc, err = _cli("train", ["--config", str(cfg), "--dry-run"], capsys)
    assert rc == 2 and len(err) == 1 and str(cfg) in err[0], err


def test_truncated_real_config_files_give_one_line(tmp_path, capsys, repo):
    tried = 0
    for src in sorted((repo / "configs").glob("*.yaml")):
        job = src.stem
        if job not in JOBS:
            continue
        text = src.read_text()
        for frac in (0.3, 0.6, 0.9):
            cut = tmp_path / f"{job}-{frac}.yaml"
            cut.write_text(text[: int(len(text) * frac)] + "\n  bad: [")
            rc, err = _cli(job, ["--config", str(cut), "--dry-run"], capsys)
            tried += 1
            assert rc == 2 and len(err) == 1 and str(cut) in err[0], (src, frac, err)
    assert tried >= 9


# ---------------------------------------------------------------------------- manifests and scaling files
@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from train_fixtures import write_digit_shards

    return write_digit_shards(tmp_path_factory.mktemp("hostile") / "shards", workers=2, n_train=128, n_test=32,
                              n_val=32)


def _train_args(man: Path, out: Path, *extra: str) -> list[str]:
    return ["--manifest", str(man), "--output", str(out), "--launcher", "local", "--epochs", "1",
            "--batch_size", "16", "--progress", "false", "--max_restarts", "0", *extra]


def _manifest_variants(good: str) -> dict[str, str]:
    d = json.loads(good)
    no_workers = {k: v for k, v in d.items() if k != "workers"}
    bad_path = json.loads(good)
    bad_path["workers"][1]["path"] = "/nonexistent/worker_001"
    bad_rows = json.loads(good)
    bad_rows["workers"][0]["rows"] = "many"
    return {"truncated": good[: len(good) // 2], "empty": "", "list": "[1, 2]", "no_workers": json.dumps(no_workers),
            "missing_shard": json.dumps(bad_path), "rows_not_int": json.dumps(bad_rows), "binary": "\x00\xff\x00"}


@pytest.mark.parametrize("variant", ["truncated", "empty", "list", "no_workers", "missing_shard", "rows_not_int",
                                     "binary"])
def test_broken_manifest_gives_one_line_naming_it(tmp_path, shards, capsys, variant):
    man = tmp_path / "manifest.json"
    man.write_text(_manifest_variants(shards.read_text())[variant])
    out = tmp_path.parent / f"{tmp_path.name}-out"      # beside the shard folder, not inside it
    rc, err = _cli("train", _train_args(man, out), capsys)
    assert rc == 2 and len(err) == 1, err
    assert "manifest.json" in err[0] or "worker_001" in err[0], err[0]
    assert not out.exists()


@pytest.mark.parametrize("text", ['{"mean": [0.0, 1.0', "[]", '{"mean": [0, 0], "std": [1, 1]}', "",
                                  '{"hlf": {"mean": "x", "std": [1]}}'])
def test_broken_scaling_json_gives_one_line_naming_it(tmp_path, text):
    from pipeline.data.shard_reader import load_scaling
    from pipeline.errors import BadInputError

    p = tmp_path / "scaling.json"
    p.write_text(text)
    with pytest.raises(BadInputError) as e:
        load_scaling(str(p))
    assert str(p) in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- corrupted Parquet parts
def _corrupt_part(part: Path, how: str) -> str:
    """Damage ``part``; return what the error must name (the file or the column)."""
    t = pq.read_table(part)
    if how == "truncated":
        data = part.read_bytes()
        part.write_bytes(data[: len(data) // 2])
        return part.name
    if how == "missing_column":
        pq.write_table(t.drop_columns(["label"]), part)
        return "label"
    if how == "wrong_type":
        i = t.schema.get_field_index("label")
        pq.write_table(t.set_column(i, "label", pa.array([f"x{v}" for v in t.column("label").to_pylist()])), part)
        return "label"
    if how == "not_parquet":
        part.write_text("this is not a parquet file\n")
        return part.name
    raise ValueError(how)


CORRUPTIONS = ["truncated", "missing_column", "wrong_type", "not_parquet"]


@pytest.mark.slow
@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupted_shard_part_in_the_train_input(tmp_path, capsys, how):
    from train_fixtures import write_digit_shards

    man = write_digit_shards(tmp_path / "shards", workers=2, n_train=128, n_test=32, n_val=32)
    named = _corrupt_part(tmp_path / "shards" / "worker_001" / "part-00000.parquet", how)
    out = tmp_path / "out"
    rc, err = _cli("train", _train_args(man, out), capsys)
    assert rc == 2 and len(err) == 1, err
    assert named in err[0], err[0]
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.fixture
def dataset(tmp_path) -> Path:
    """An images-stage-like dataset (real digits) in two part files."""
    from train_fixtures import _table, mnist_digits

    X, y = mnist_digits()
    d = tmp_path / "dataset"
    d.mkdir()
    import numpy as np

    ids = np.arange(200)
    pq.write_table(_table(ids[:100], X, y, "train"), d / "part-00000.parquet")
    pq.write_table(_table(ids[100:], X, y, "train"), d / "part-00001.parquet")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "not_parquet", "wrong_type_key", "missing_key"])
def test_corrupted_part_in_the_shard_input(spark, tmp_path, dataset, capsys, how):
    part = dataset / "part-00001.parquet"
    if how in ("truncated", "not_parquet"):
        named = _corrupt_part(part, how)
    else:
        t = pq.read_table(part)
        if how == "missing_key":
            pq.write_table(t.drop_columns(["split"]), part)
        else:
            i = t.schema.get_field_index("sample_id")
            pq.write_table(t.set_column(i, "sample_id", pa.array([str(v) for v in t.column("sample_id").to_pylist()])),
                           part)
        named = "split" if how == "missing_key" else "sample_id"
    out = tmp_path / "shards"
    rc, err = _cli("shard", ["--input", str(dataset), "--output", str(out), "--workers", "2"], capsys)
    assert rc == 2 and len(err) == 1, err
    assert named in err[0], err[0]
    assert not out.exists()


# ---------------------------------------------------------------------------- output directory and disk
_NO_MOUNT = "mounting a small tmpfs needs root (CAP_SYS_ADMIN), as in CI: run the suite as root"


def _mount_tmpfs(where: Path, size: str, readonly: bool = False) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True).returncode == 0


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _previous_output(out: Path, name: str, text: str) -> None:
    """A committed output of ours holding one file (its _COMPLETE marker lists it)."""
    out.mkdir()
    (out / name).write_text(text)
    (out / "_COMPLETE").write_text(json.dumps({"format": 2, "job": "0" * 12, "files": [name]}))


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    assert _mount_tmpfs(mnt, "96k"), _NO_MOUNT
    yield mnt
    _umount(mnt)


@pytest.mark.slow
def test_a_disk_that_fills_during_the_write_leaves_the_previous_output_untouched(tmp_path, shards, small_disk, capsys):
    out = small_disk / "train"
    _previous_output(out, "summary.json", '{"previous": true}\n')
    rc, err = _cli("train", _train_args(shards, out, "--checkpoint_dir", str(tmp_path / "ck")), capsys)
    assert rc != 0 and len(err) == 1, err
    assert "No space left on device" in err[0] or "write failed" in err[0], err[0]
    print(err[0])
    assert json.loads((out / "summary.json").read_text()) == {"previous": True}
    assert sorted(p.name for p in small_disk.iterdir()) == ["train"]  # no temporary directory left


@pytest.mark.slow
def test_an_output_directory_that_is_not_writable(tmp_path, shards, capsys):
    mnt = tmp_path / "ro"
    assert _mount_tmpfs(mnt, "1m"), _NO_MOUNT
    try:
        _previous_output(mnt / "train", "summary.json", '{"previous": true}\n')
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        out = mnt / "train"
        rc, err = _cli("train", _train_args(shards, out, "--checkpoint_dir", str(tmp_path / "ck")), capsys)
        assert rc == 2 and len(err) == 1, err
        assert str(mnt) in err[0] and "Read-only file system" in err[0], err[0]
        assert json.loads((out / "summary.json").read_text()) == {"previous": True}
    finally:
        _umount(mnt)


@pytest.mark.slow
def test_a_full_disk_under_a_spark_stage_names_the_cause(spark, tmp_path, dataset, small_disk, capsys):
    """The shard stage's Spark tasks write the parts: the error raised in the Python worker
    reaches the user as its own one line, not as Spark's 'see the stack trace below'."""
    out = small_disk / "shards"
    _previous_output(out, "manifest.json", "{}\n")
    st = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - 16 * 1024))  # 16 KiB left
    rc, err = _cli("shard", ["--input", str(dataset), "--output", str(out), "--workers", "2"], capsys)
    assert rc == 1 and len(err) == 1, err
    assert "No space left on device" in err[0], err[0]
    assert (out / "manifest.json").read_text() == "{}\n"
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "shards"]


@pytest.mark.slow
def test_a_full_disk_under_the_feature_stage_fails_the_run_not_the_input_file(spark, tmp_path, delphes_root,
                                                                               small_disk, capsys):
    """The feature tasks leave their selected events in work files on the output's disk: a disk
    that fills there is the stage's failure (one line naming the cause, exit 1, the previous output
    untouched, nothing left behind), not a bad input file."""
    import shutil

    src = tmp_path / "in"
    src.mkdir()
    for i in range(4):
        shutil.copyfile(delphes_root, src / f"ttbar_{i}.root")
    out = small_disk / "features"
    _previous_output(out, "report.json", "{}\n")
    st = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - 2 * 1024))  # 2 KiB left
    samples = json.dumps([{"name": "ttbar", "label": 1, "files": [str(src / "*.root")]}])
    rc, err = _cli("features", ["--samples", samples, "--input", str(src / "*.root"), "--output", str(out)], capsys)
    assert rc == 1 and len(err) == 1, err
    assert "No space left on device" in err[0], err[0]
    assert (out / "report.json").read_text() == "{}\n"
    assert sorted(p.name for p in small_disk.iterdir()) == ["features", "filler"]
    # the task itself raises (a status row would report the ROOT file as bad)
    from pipeline.commit import JobTarget
    from pipeline.features.tasks import feature_partition

    (small_disk / "work").mkdir()
    chunk = pa.RecordBatch.from_pydict({"file_index": [0], "path": [str(delphes_root)], "tree": ["Delphes"],
                                        "entry_start": [0], "entry_stop": [25]})
    with pytest.raises(OSError, match="No space left on device"):
        list(feature_partition(iter([chunk]), target=JobTarget(str(small_disk / "work")), compression="lz4"))

