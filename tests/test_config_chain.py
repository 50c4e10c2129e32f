"""The default configs form the documented chain: each job's default input is what the previous step
writes with its default config, and ``make run`` (the HEP pipeline) and ``make run-images`` (the
image slice) write exactly those paths. So right after ``make run``, ``spark-submit jobs/train.py
--config configs/train.yaml`` trains the model that ``make run``'s data feeds (the run itself is in
tests/test_readme_commands.py). Every config with an input says in its first lines which command
writes it, and a missing input names that command.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from shell_fixtures import REPO, VENV_BIN, clean_env, lines, sh
from train_fixtures import write_hlf_shards

CONFIGS = REPO / "configs"


def _cfg(cls, name: str):
    from pipeline.config import load_config

    return load_config(cls, CONFIGS / name)


def _make_run_paths() -> dict:
    """Where ``make run`` (configs/run_hep.yaml) writes each stage's output, relative to the checkout."""
    from pipeline.workflows import HepRunConfig, _hep_paths, hep_stage_configs

    from pipeline.fs import location

    run = _cfg(HepRunConfig, "run_hep.yaml").model_copy(update={"real_samples": False})
    return hep_stage_configs(run, _hep_paths(location(run.output_root, output=True)))


def _abs(path: str) -> str:
    """A config's relative path as the workflow derives it (absolute, from the working directory)."""
    from pipeline.fs import location

    return str(location(path))


def test_the_hep_defaults_chain_from_make_run():
    from pipeline.features.stage import FeaturesConfig
    from pipeline.ingest.root import IngestRootConfig
    from pipeline.shards.materialize import ShardConfig
    from pipeline.simulate.config import SimulateConfig
    from pipeline.train.config import TrainConfig

    made = _make_run_paths()
    sim, ing = _cfg(SimulateConfig, "simulate.yaml"), _cfg(IngestRootConfig, "ingest_root.yaml")
    feat, sh_, tr = _cfg(FeaturesConfig, "features.yaml"), _cfg(ShardConfig, "shard.yaml"), _cfg(TrainConfig, "train.yaml")
    assert _abs(sim.output) == made["simulate"].output
    assert ing.input in (f"{sim.output}/*/*.root", [f"{sim.output}/*/*.root"]) and ing.tree == "Delphes"
    assert _abs(ing.output) == made["ingest"].output
    assert feat.input == ing.output and _abs(feat.output) == made["features"].output
    assert sh_.input == f"{feat.output}/hlf" and _abs(sh_.input) == made["shard"].input
    assert _abs(sh_.output) == made["shard"].output
    assert sh_.workers == made["shard"].workers
    assert tr.manifest == f"{sh_.output}/manifest.json" and _abs(tr.manifest) == made["train"].manifest
    assert tr.model == made["train"].model == "hlf" and _abs(tr.output) == made["train"].output
    # the same training as make run's (the paths aside): a rerun of its last stage
    keep = {"manifest", "output", "scaling", "workers"}
    assert tr.model_dump(exclude=keep) == made["train"].model_dump(exclude=keep)


def test_the_training_examples_read_what_their_header_names():
    """configs/train/*.yaml read the shards of ``make run-images`` (or of ``make run`` for the HLF
    example), as their first lines say."""
    from pipeline.train.config import TrainConfig
    from pipeline.workflows import HepRunConfig, ImagesRunConfig

    images = f"{_cfg(ImagesRunConfig, 'run_images.yaml').output_root}/shards/manifest.json"
    hep = f"{_cfg(HepRunConfig, 'run_hep.yaml').output_root}/shards/manifest.json"
    for path in sorted((CONFIGS / "train").glob("*.yaml")):
        cfg = _cfg(TrainConfig, f"train/{path.name}")
        want = {images: "make run-images", hep: "make run"}.get(cfg.manifest)
        assert want, f"{path.name}: manifest {cfg.manifest} is written by no documented command"
        assert _producer(path) == want, f"{path.name}: its first lines should say `{want}` writes its input"


def _producer(path: Path):
    from pipeline.config import input_producer

    found = input_producer(path)
    return found[1] if found else None


@pytest.mark.parametrize("name,producer", [("features.yaml", "make run"), ("shard.yaml", "make run"),
                                           ("train.yaml", "make run"), ("ingest_root.yaml", "make run")])
def test_a_config_with_an_input_names_its_producer_in_its_first_lines(name, producer):
    head = "\n".join(ln for ln in (CONFIGS / name).read_text().splitlines()[:4])
    assert re.search(rf"written by `{re.escape(producer)}`", head), head
    assert _producer(CONFIGS / name) == producer


@pytest.mark.slow
@pytest.mark.parametrize("how", ["spark-submit", "python -m"])
def test_a_missing_input_names_the_command_that_writes_it(how, tmp_path):
    """A new checkout without ``make run``: the training default stops with one line naming the
    missing manifest and ``make run``."""
    cfg = str(CONFIGS / "train.yaml")
    cmd = ([str(VENV_BIN / "spark-submit"), str(REPO / "jobs" / "train.py"), "--config", cfg] if how == "spark-submit"
           else [str(VENV_BIN / "python"), "-m", "jobs.train", "--config", cfg])
    r = sh(cmd, cwd=tmp_path, env=clean_env(), timeout=300, merged=True)
    assert r.returncode == 2, r.stdout[-2000:]
    last = lines(r.stdout)[-1]
    assert last.startswith("error:") and "runs/hep/shards/manifest.json" in last and "`make run`" in last, last


# ------------------------------------------------------------------ the built-in defaults (no --config)
def test_the_built_in_defaults_chain_like_the_configs():
    """Each stage's config with no file and no value given (the bare job) reads what the previous
    stage writes with its own built-in defaults, at the paths of configs/*.yaml and of ``make run``."""
    from pipeline.features.stage import FeaturesConfig
    from pipeline.ingest.root import IngestRootConfig
    from pipeline.report.curves import ReportConfig
    from pipeline.shards.materialize import ShardConfig
    from pipeline.simulate.config import SimulateConfig
    from pipeline.train.config import TrainConfig

    sim, ing, feat, sh_, tr = SimulateConfig(), IngestRootConfig(), FeaturesConfig(), ShardConfig(), TrainConfig()
    assert sim.output == "runs/hep/simulated"
    assert ing.input == f"{sim.output}/*/*.root" and ing.tree == "Delphes" and ing.output == "runs/hep/events"
    assert feat.input == ing.output and feat.tree == ing.tree and feat.output == "runs/hep/features"
    assert sh_.input == f"{feat.output}/hlf" and sh_.output == "runs/hep/shards"
    assert tr.manifest == f"{sh_.output}/manifest.json" and tr.output == "runs/hep/train"
    assert ReportConfig().runs == [tr.output]
    # the same paths and labels as the config files (the documented chain) and as make run
    yaml = {"simulate": _cfg(SimulateConfig, "simulate.yaml"), "ingest": _cfg(IngestRootConfig, "ingest_root.yaml"),
            "features": _cfg(FeaturesConfig, "features.yaml"), "shard": _cfg(ShardConfig, "shard.yaml"),
            "train": _cfg(TrainConfig, "train.yaml")}
    made = _make_run_paths()
    for stage, cfg in {"simulate": sim, "ingest": ing, "features": feat, "shard": sh_, "train": tr}.items():
        for key in ("input", "output", "manifest", "tree", "workers"):
            if key in type(cfg).model_fields:
                assert getattr(cfg, key) == getattr(yaml[stage], key), f"{stage}.{key}"
        for key in ("output", "manifest"):
            if key in type(cfg).model_fields:
                assert _abs(getattr(cfg, key)) == _abs(getattr(made[stage], key)), f"{stage}.{key}"
    assert [(s.name, s.label) for s in feat.samples] == [(s.name, s.label) for s in yaml["features"].samples]
    assert [s.files for s in feat.samples] == [s.files for s in yaml["features"].samples]


@pytest.mark.needs_horovod   # the bare job's launcher is the default, horovod
def test_the_bare_training_job_trains_on_what_make_run_wrote(tmp_path, monkeypatch, capsys, spark):
    """``jobs/train.py`` with no option, in a checkout where ``make run`` ran: the HLF shards under
    runs/hep/shards with the HLF model (the model follows the shards when none is given); where
    they are missing, one line naming the manifest and `make run`."""
    import json

    from jobs.train import main

    monkeypatch.chdir(tmp_path)
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: shard manifest not found:") and "runs/hep/shards/manifest.json" in err, err
    assert "`make run`" in err, err
    write_hlf_shards(tmp_path / "runs" / "hep" / "features", tmp_path / "runs" / "hep" / "shards")
    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[:out.rindex("}") + 1])["plan"]
    assert plan["model"] == "hlf" and plan["inputs"] == [str(tmp_path / "runs/hep/shards/manifest.json")], plan
    assert plan["outputs"][0] == str(tmp_path / "runs/hep/train")


@pytest.mark.parametrize("job,missing", [("ingest_root", "runs/hep/simulated"), ("features", "runs/hep/events"),
                                         ("shard", "runs/hep/features/hlf")])
def test_a_bare_job_with_its_input_missing_names_the_command_that_writes_it(job, missing, tmp_path, monkeypatch,
                                                                          capsys, spark):
    # ``spark``: the suite's shared local[2] session exists before the job asks for one (a job run
    # in-process takes the session that exists; its own default would be local[*])
    import importlib

    monkeypatch.chdir(tmp_path)
    assert importlib.import_module(f"jobs.{job}").main(["--dry-run"] if job == "ingest_root" else []) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and missing in err and "`make run`" in err, err
