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
