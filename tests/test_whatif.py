"""``jobs/whatif.py`` through its documented command (docs/training.md, "Which algorithm, how many
workers"): a training config and a cluster in, the virtual time to a target and its cost per
algorithm and worker count out (table on stdout, table.csv, table.json, whatif.png). On the HLF
model with learnable labels, 2 algorithms x M in {1, 2}, a few steps: a slower link gives AR-SGD
more virtual time for the same bytes, every cell has its row, and a row's time to target is the
virtual time of the first validation record at the target in the same run's own records."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from shell_fixtures import REPO, VENV_BIN, sh
from train_fixtures import write_hlf_shards

TARGET = 0.6
ALGORITHMS = "arsgd,local_sgd:period=4"


@pytest.fixture(scope="module")
def train_config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("whatif")
    manifest = write_hlf_shards(root / "features", root / "shards", learnable=True, n_eval=128,
                                row_group_rows=64)
    cfg = root / "hlf.yaml"
    cfg.write_text(f"manifest: {manifest}\noutput: {root / 'unused'}\nmodel: hlf\noptimizer: adam\nlr: 0.01\n"
                   "lr_scaling: none\nwarmup_epochs: 0\nbatch_size: 16\nepochs: 20\nseed: 0\n"
                   "simulated_clock:\n  step_s: 0.002\n")
    return cfg


def _command(train_config: Path, cluster: str, out: Path, algorithms: str = ALGORITHMS, workers: str = "1,2") -> str:
    return (f"{VENV_BIN / 'python'} -m jobs.whatif --train_config {train_config} --cluster {cluster} "
            f"--algorithms {algorithms} --workers {workers} --target {TARGET} --max_steps 24 --eval_every 4 "
            f"--output {out}")


@pytest.fixture(scope="module")
def tables(train_config, tmp_path_factory) -> dict:
    """The command on a 1 GbE cluster (every cell) and on 100 Gb InfiniBand (AR-SGD at M = 2 only),
    one rank per node. About 25 s on 2 loaded cores: two interpreters that import torch, five runs."""
    out = {}
    for cluster, algorithms, workers in (("gbe1", ALGORITHMS, "1,2"), ("ib100", "arsgd", "2")):
        d = tmp_path_factory.mktemp(cluster) / "whatif"
        r = sh(_command(train_config, cluster, d, algorithms, workers), cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out[cluster] = {"stdout": r.stdout, "stderr": r.stderr, "dir": d,
                        "json": json.loads((d / "table.json").read_text()),
                        "csv": list(csv.DictReader((d / "table.csv").open()))}
    return out


def test_every_cell_has_its_row_in_the_table_the_csv_and_the_plot(tables):
    assert [(r["algorithm"], r["workers"]) for r in tables["ib100"]["json"]["rows"]] == [("arsgd", 2)]
    for cluster, t in [("gbe1", tables["gbe1"])]:
        cells = {(r["algorithm"], r["workers"]) for r in t["json"]["rows"]}
        assert cells == {(a, m) for a in ("arsgd", "local_sgd:period=4") for m in (1, 2)}
        assert [(r["algorithm"], int(r["workers"])) for r in t["csv"]] == [(r["algorithm"], r["workers"])
                                                                           for r in t["json"]["rows"]]
        for r in t["json"]["rows"]:
            assert r["steps"] == 24 and r["virtual_s"] > 0 and r["samples_per_s"] > 0
            assert r["reached"], f"{cluster} {r['algorithm']} M={r['workers']} did not reach {TARGET}: {r}"
            assert 0 < r["time_to_target_s"] <= r["virtual_s"] and r["step_to_target"] <= r["steps"]
            assert r["cost"] == pytest.approx(r["nodes"] * r["time_to_target_s"] / 3600)
        # the printed table: a line per cell, the answer, then the job's summary; progress per run on stderr
        lines = t["stdout"].splitlines()
        assert sum(line.startswith(("arsgd ", "local_sgd:period=4 ")) for line in lines) == 4
        assert any(line.startswith(f"fastest to {TARGET:g}: ") for line in lines)
        assert lines[-1].startswith("SUMMARY whatif: 4 runs on ")
        assert [line.split(" ")[1] for line in t["stderr"].splitlines() if line.startswith("whatif [")] == \
            ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
        assert (t["dir"] / "whatif.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_slower_link_gives_ar_sgd_more_virtual_time_for_the_same_bytes(tables):
    rows = {c: {(r["algorithm"], r["workers"]): r for r in t["json"]["rows"]} for c, t in tables.items()}
    slow, fast = rows["gbe1"][("arsgd", 2)], rows["ib100"][("arsgd", 2)]
    assert slow["virtual_s"] > fast["virtual_s"] and slow["comm_share"] > fast["comm_share"]
    assert slow["time_to_target_s"] > fast["time_to_target_s"]
    assert slow["inter_node_bytes"] == fast["inter_node_bytes"] > 0
    # the same parameters: AR-SGD is synchronous, the link changes only the time
    assert slow["step_to_target"] == fast["step_to_target"]
    assert slow["final_val_accuracy"] == fast["final_val_accuracy"]
    # one worker crosses no link; local SGD (averaging every 4 steps) pays less of the slow link than AR-SGD
    assert rows["gbe1"][("arsgd", 1)]["inter_node_bytes"] == 0
    assert rows["gbe1"][("local_sgd:period=4", 2)]["comm_share"] < slow["comm_share"]


def test_a_row_is_its_runs_own_records(tables, train_config, tmp_path):
    """AR-SGD at M = 2 on 1 GbE, trained again here on the same resharded data and cluster: the row's
    time to target is the virtual time of the run's first validation at or above the target."""
    from pipeline.config import load_config
    from pipeline.studies.whatif import WhatIfConfig, _run_config, reshard
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    cfg = WhatIfConfig(train_config=str(train_config), cluster="gbe1", algorithms="arsgd", workers="2",
                       target=TARGET, max_steps=24, eval_every=4, output=str(tmp_path / "unused"))
    base = load_config(TrainConfig, train_config)
    manifest = reshard(base.manifest, 2, base.seed, tmp_path / "shards")
    run = train(_run_config(cfg, base, {"name": "arsgd", "params": {}}, 2, manifest, tmp_path))
    records = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if r["kind"] == "eval" and r["split"] == "val"]
    first = next(r for r in vals if r["accuracy"] >= TARGET)
    row = next(r for r in tables["gbe1"]["json"]["rows"] if (r["algorithm"], r["workers"]) == ("arsgd", 2))
    assert (row["step_to_target"], row["time_to_target_s"]) == (first["step"], first["virtual_s"])
    assert row["virtual_s"] == run["ranks"][0]["simulated_clock"]["virtual_s"]
    assert row["final_val_accuracy"] == vals[-1]["accuracy"]
    # the virtual time of the records rises with the steps
    assert [r["virtual_s"] for r in vals] == sorted(r["virtual_s"] for r in vals) and vals[0]["virtual_s"] > 0


@pytest.mark.parametrize("option,expect", [
    ("--cluster gbe5", "cluster 'gbe5': neither a preset (gbe1, gbe10, ib100, nvlink) nor a YAML file"),
    ("--algorithms arsgd,nosuch", "unknown algorithm 'nosuch'"),
    ("--workers 0,2", "workers"),
    ("--workers 1,64", "workers=64: 256 training rows"),     # 4 rows a worker, fewer than its batch of 16
])
def test_a_bad_value_is_one_line_and_no_output(train_config, tmp_path, option, expect):
    out = tmp_path / "whatif"
    cmd = _command(train_config, "gbe1", out)
    key = option.split(" ")[0]
    cmd = cmd.replace(f"{key} {cmd.split(key + ' ')[1].split(' ')[0]}", option)
    r = sh(cmd, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], r.stderr
    assert not out.exists() and r.stdout == ""


@pytest.mark.parametrize("text, says", [("preset: [gbe1\n", "is not valid YAML"),
                                         ("- gbe1\n", "must hold a mapping at the top level")])
def test_a_cluster_file_that_is_not_a_mapping_of_fields_is_one_line_naming_it(tmp_path, text, says):
    from pipeline.errors import ConfigError
    from pipeline.studies.whatif import cluster_fields

    bad = tmp_path / "cluster.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError) as e:
        cluster_fields(str(bad), 4)
    assert str(bad) in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_the_documented_example_is_the_committed_run():
    """docs/training.md's example table shows results/whatif/hlf_gbe10/table.json's rows."""
    import re

    rows = json.loads((REPO / "results" / "whatif" / "hlf_gbe10" / "table.json").read_text())["rows"]
    page = (REPO / "docs" / "training.md").read_text()
    shown = re.findall(r"^\| `([^`]+)` \| (\d+) \| ([-\d.]+) \| ([-\d]+) \|", page, flags=re.M)
    assert shown == [(r["algorithm"], str(r["workers"]),
                      "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s'] * 1e3:.1f}",
                      "-" if r["step_to_target"] is None else str(r["step_to_target"])) for r in rows]
