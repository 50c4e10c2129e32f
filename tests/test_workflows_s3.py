"""The HEP workflow with its output_root on an object store: every stage's input and output are
derived under the prefix (the run itself on a cluster: tests/test_cluster_isolated.py)."""
from __future__ import annotations

import json


def test_run_hep_plans_every_stage_under_an_s3_output_root(capsys):
    from jobs.run_hep import main
    from pipeline.fs import location
    from pipeline.workflows import HepRunConfig, _hep_paths, hep_stage_configs

    assert main(["--config", "configs/run_hep.yaml", "--set", "output_root=s3://bucket/hep", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["outputs"]["features"] == "s3://bucket/hep/features"
    assert plan["outputs"]["real_nanoaod"] == "s3://bucket/hep/real/nanoaod"
    cfg = HepRunConfig(output_root="s3://bucket/hep", real_samples=False)
    st = hep_stage_configs(cfg, _hep_paths(location(cfg.output_root, output=True)))
    assert st["simulate"].output == "s3://bucket/hep/simulated"
    assert st["ingest"].input == "s3://bucket/hep/simulated/*/*.root"
    assert st["features"].samples[0].files == ["s3://bucket/hep/simulated/qcd/*.root"]
    assert (st["shard"].input, st["shard"].output) == ("s3://bucket/hep/features/hlf", "s3://bucket/hep/shards")
    assert st["train"].manifest == "s3://bucket/hep/shards/manifest.json"
    assert st["train"].scaling == "s3://bucket/hep/features/scaling.json"
    assert st["train"].output == "s3://bucket/hep/train"
