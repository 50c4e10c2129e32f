"""No output inside an input, no input inside an output (issue 34, item 2): the one shared check
(:mod:`pipeline.paths_overlap`) on local paths (symlinks and ``..`` resolved) and ``s3://``
prefixes (``s3a://`` the same store), and every stage's use of it before any work."""
from __future__ import annotations

import os
import shutil

import pytest

from pipeline.errors import ConfigError
from pipeline.paths_overlap import check_apart, overlaps


def test_the_same_path_and_one_inside_the_other_overlap(tmp_path):
    a = tmp_path / "data"
    assert overlaps(a, a) and overlaps(a, a / "x.root") and overlaps(a / "x.root", a)
    assert overlaps(str(a) + "/", a)


def test_a_sibling_with_a_common_name_prefix_does_not_overlap(tmp_path):
    assert not overlaps(tmp_path / "out", tmp_path / "out2")
    assert not overlaps(tmp_path / "out2" / "x", tmp_path / "out")
    assert not overlaps("s3://b/out", "s3://b/out2/part")
    assert not overlaps("s3://b/out", "s3://b2/out")


def test_dotdot_is_resolved_before_comparing(tmp_path):
    (tmp_path / "a").mkdir()
    assert overlaps(tmp_path / "a" / ".." / "data", tmp_path / "data" / "x.root")
    assert not overlaps(tmp_path / "data" / ".." / "other", tmp_path / "data")


def test_symlinks_are_resolved_before_comparing(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "x.root").write_bytes(b"x")
    link = tmp_path / "link"
    os.symlink(real, link)
    assert overlaps(link, real / "x.root")          # the output is a link to the input's folder
    assert overlaps(real, link / "x.root")          # the input is reached through a link
    assert not overlaps(tmp_path / "other", link / "x.root")


def test_s3_prefixes_and_the_s3a_alias(tmp_path):
    assert overlaps("s3://b/data", "s3://b/data/x.root")
    assert overlaps("s3a://b/data/", "s3://b/data/x.root")
    assert overlaps("s3://b", "s3://b/data/x.root")          # a whole bucket holds every key
    assert overlaps("s3://b/a/../data", "s3://b/data/x.root")
    assert not overlaps("s3://b/data", "s3://b/database/x.root")
    assert not overlaps(tmp_path / "b" / "data", "s3://b/data")            # another filesystem
    assert not overlaps("s3://b/data", "root://host//b/data/x.root")         # read by uproot only


def test_a_clash_is_one_config_error_naming_both_paths(tmp_path):
    out = tmp_path / "data"
    with pytest.raises(ConfigError) as e:
        check_apart(out, [tmp_path / "elsewhere.root", out / "nano_dy.root"])
    msg = str(e.value)
    assert "\n" not in msg and str(out) in msg and str(out / "nano_dy.root") in msg
    assert e.value.exit_code == 2
    with pytest.raises(ConfigError, match="manifest"):
        check_apart(out / "model", [out], output_name="output", input_name="shard folder of the manifest")
    check_apart(tmp_path / "out2", [tmp_path / "out", tmp_path / "out/x.root"])   # no clash: nothing raised
    check_apart("s3://b/out", ["s3://b/in/x.root", "root://h//b/out/x.root"])


# ---------------------------------------------------------------------------- the stages
def _tree(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_ingest_root_into_the_folder_of_its_input_exits_2_and_keeps_both_files(tmp_path, samples_dir, capsys,
                                                                               monkeypatch):
    """The issue's headline: ``--input data/nano_dy.root --output data`` (with another file beside)."""
    from jobs.ingest_root import main

    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(samples_dir / "nano_dy.root", data / "nano_dy.root")
    shutil.copy(samples_dir / "nano_dy.root", data / "other.root")
    before = _tree(data)
    monkeypatch.chdir(tmp_path)
    rc = main(["--input", "data/nano_dy.root", "--tree", "Events", "--output", "data"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1, err
    assert str(data) in err[0] and str(data / "nano_dy.root") in err[0], err[0]
    assert _tree(data) == before


@pytest.mark.parametrize("inp,out", [
    ("{d}/*.root", "{d}"),                       # a glob's files inside the output
    ("{d}/nano_dy.root", "{d}/nano_dy.root/x"),  # the output inside an input
    ("{d}/sub/../nano_dy.root", "{link}"),       # `..` and a symlink to the folder
    ("s3://bucket/data/nano_dy.root", "s3a://bucket/data"),
])
def test_ingest_root_refuses_any_overlap_before_any_work(tmp_path, samples_dir, inp, out):
    from pipeline.ingest.root import IngestRootConfig, ingest_root

    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    shutil.copy(samples_dir / "nano_dy.root", d / "nano_dy.root")
    os.symlink(d, tmp_path / "link")
    before = _tree(d)
    cfg = IngestRootConfig(input=inp.format(d=d), tree="Events", output=out.format(d=d, link=tmp_path / "link"))
    with pytest.raises(ConfigError, match="overlaps"):
        ingest_root(cfg, spark=object())          # refused before Spark is used
    assert _tree(d) == before


def test_ingest_images_refuses_an_output_holding_its_input(tmp_path, mnist_csv):
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images

    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(mnist_csv, d / mnist_csv.name)
    before = _tree(d)
    for out in (d, d / mnist_csv.name / "out"):
        with pytest.raises(ConfigError, match="overlaps"):
            ingest_images(ImagesIngestConfig(input=str(d / mnist_csv.name), output=str(out)), spark=object())
    assert _tree(d) == before


def test_features_refuses_an_output_inside_its_ingested_dataset_or_holding_its_files(tmp_path, delphes_root):
    from pipeline.features.stage import FeaturesConfig, build_features

    ds = tmp_path / "events"
    ds.mkdir()
    (ds / "_report.json").write_text('{"branches": [], "files": []}')
    root = tmp_path / "raw"
    root.mkdir()
    shutil.copy(delphes_root, root / "delphes.root")
    for inp, out in ((str(ds), ds / "features"), (str(root / "*.root"), root), (str(ds), tmp_path)):
        with pytest.raises(ConfigError, match="overlaps"):
            build_features(FeaturesConfig(input=inp, output=str(out), samples=[{"name": "qcd", "files": ["*.root"], "label": 0}]),
                           spark=object())
    assert sorted(p.name for p in ds.iterdir()) == ["_report.json"]
    assert sorted(p.name for p in root.iterdir()) == ["delphes.root"]


def test_shard_uses_the_shared_check(tmp_path):
    from pipeline.shards.materialize import ShardConfig, shard

    d = tmp_path / "in"
    d.mkdir()
    os.symlink(d, tmp_path / "link")
    for out in (tmp_path / "link" / "shards", tmp_path / "in" / "x" / ".." / ".." / "in", tmp_path):
        with pytest.raises(ConfigError, match="overlaps"):
            shard(ShardConfig(input=str(d), output=str(out)), spark=object())
    with pytest.raises(ConfigError, match="overlaps"):
        shard(ShardConfig(input="s3://b/in", output="s3a://b/in/shards"), spark=object())


def test_train_refuses_an_output_overlapping_the_shard_folder(tmp_path):
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import check_targets

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    os.symlink(shards, tmp_path / "link")
    for out in (shards, shards / "model", tmp_path, tmp_path / "link" / "model"):
        with pytest.raises(ConfigError, match="overlaps") as e:
            check_targets(TrainConfig(manifest=str(shards / "manifest.json"), output=str(out),
                                      checkpoint_dir=str(tmp_path / "ck")))
        assert str(shards) in str(e.value) and "\n" not in str(e.value)
    check_targets(TrainConfig(manifest=str(shards / "manifest.json"), output=str(tmp_path / "shards2")))
    with pytest.raises(ConfigError, match="overlaps the output"):     # and the checkpoints against the output
        check_targets(TrainConfig(manifest=str(shards / "manifest.json"), output=str(tmp_path / "o"),
                                  checkpoint_dir=str(tmp_path / "link2" / ".." / "o" / "ck")))


def test_a_study_or_search_work_folder_of_someone_elses_is_refused(tmp_path):
    """A study (tune) writes into its work folder and deletes unfinished runs there: a folder that
    holds files and no study.json (optuna.journal) of ours is refused, and nothing in it changes."""
    from pipeline.train.config import TrackingConfig
    from pipeline.errors import BadInputError
    from pipeline.studies.workspace import open_workspace

    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("x")
    for own in ("study.json", "optuna.journal"):
        with pytest.raises(BadInputError, match=r"mine: not a folder of this pipeline's \(it holds thesis.tex"):
            open_workspace(str(user), None, None, "runs/x", TrackingConfig(enabled=False), own)
    assert sorted(p.name for p in user.iterdir()) == ["thesis.tex"]
    (user / "study.json").write_text("{}")
    assert open_workspace(str(user), None, None, "runs/x", TrackingConfig(enabled=False), "study.json").out == user


def test_a_folder_of_someone_elses_named_as_output_is_refused_before_spark_starts(tmp_path, delphes_root,
                                                                                  monkeypatch, capsys):
    """``--output mine`` where mine/ holds a user's file: one line naming it, exit 2, before the stage
    asks for a Spark session, and the file stays."""
    from jobs.ingest_root import main
    from pipeline.ingest.root import stage

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")

    def no_spark(*a, **k):
        raise AssertionError("Spark was started")

    monkeypatch.setattr(stage, "get_spark", no_spark)
    rc = main(["--input", str(delphes_root), "--tree", "Delphes", "--output", str(mine)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and "it holds thesis.tex" in err[-1], err
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]
