"""The time claims of docs/results.md (``pipeline/studies/time_claims.py``): the virtual-time columns a
clocked run records (``results.clock_metrics``), the rule that turns them into verdicts, the tables
generated from the committed records, and a compute profile named by file (``cluster.compute_profile``).

The rule is checked on hand-made values where the answer is known; the clock columns on a real
in-process run of the HLF classifier on 2 workers under the cost model."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from pipeline.errors import ConfigError
from pipeline.studies import time_claims as tc
from pipeline.studies.tables import PAGE, RESULTS
from train_fixtures import write_hlf_shards

NAN = math.nan


# ----------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("x, c, at_least, word", [
    (2.4, 2.0, True, "agrees"),            # beyond 2 x 1.15
    (2.2, 2.0, True, "not resolvable"),    # within the model's 15 %
    (1.7, 2.0, True, "disagrees"),         # below 2 / 1.15
    (0.9, 1.1, False, "agrees"),           # at most 1.1: below 1.1 / 1.15
    (1.3, 1.1, False, "disagrees"),
    (NAN, 1.0, True, "not resolvable"),
])
def test_a_bound_on_a_modelled_ratio_is_judged_with_the_models_tolerance(x, c, at_least, word):
    assert tc.threshold_verdict(x, c, at_least).startswith(word)


@pytest.mark.parametrize("g, word", [(1.0, "agrees"), (1.14, "agrees"), (1.2, "not resolvable"),
                                     (1.35, "disagrees"), (NAN, "not resolvable")])
def test_almost_constant_means_within_the_models_tolerance_of_no_growth(g, word):
    assert tc.constant_verdict(g).startswith(word)


def test_times_to_target_are_judged_by_ratio_and_one_tailed_p():
    fast, slow = [1.0, 1.1, 0.9], [2.0, 2.1, 1.9]
    assert tc.judge_times(fast, slow, "sooner")[0] == "agrees"
    assert tc.judge_times(slow, fast, "sooner")[0].startswith("disagrees")
    assert tc.judge_times(fast, slow, "later")[0].startswith("disagrees")
    # a 5 % difference, however significant, is inside the model's tolerance
    v, ratio, _ = tc.judge_times([1.0, 1.001, 0.999], [1.05, 1.051, 1.049], "sooner")
    assert v.startswith("not resolvable") and ratio == pytest.approx(1 / 1.05, rel=1e-3)
    # runs that never reached the target: the cell that never reached is the slower one
    assert tc.judge_times([NAN, NAN], [1.0, 1.2], "sooner")[0].startswith("disagrees")
    assert tc.judge_times([1.0, 1.2], [NAN, NAN], "sooner")[0].startswith("agrees")
    assert tc.judge_times([1.0, NAN], [1.0, 1.2], "sooner")[0].startswith("not resolvable (1 of 2")


def test_time_to_a_target_is_the_virtual_time_of_the_first_validation_at_it():
    rec = {"curve": [{"split": "val", "accuracy": 0.5, "virtual_s": 1.0},
                     {"split": "test", "accuracy": 0.95, "virtual_s": 1.5},
                     {"split": "val", "accuracy": 0.81, "virtual_s": 2.0},
                     {"split": "val", "accuracy": 0.9, "virtual_s": 3.0}]}
    assert tc.time_to(rec, 0.8) == 2.0
    assert tc.time_to(rec, 0.85) == 3.0
    assert math.isnan(tc.time_to(rec, 0.95))     # the test split does not count


def test_speed_up_is_m_times_the_sequential_time_per_batch_over_ms():
    assert tc.speedup(0.016, 16, [0.02, 0.02]) == pytest.approx(16 * 0.016 / 0.02)


# ----------------------------------------------------------------------------- the page
STUDIES = ("time_fig_4_2", "time_table_4_2", "time_sync_vs_eawild", "time_households")


@pytest.mark.parametrize("study", STUDIES)
def test_each_time_claim_region_of_the_results_page_is_generated_from_its_records(study):
    text = PAGE.read_text()
    regions = {m.group(2): m.group(3) for m in tc.REGION.finditer(text)}
    assert study in regions, f"docs/results.md has no results-time region for {study}"
    assert regions[study] == tc.section(study, RESULTS), "run python -m jobs.results_tables"
    assert "not resolvable at this scale" not in regions[study]


def test_the_results_page_answers_time_claims_without_not_resolvable_at_this_scale():
    assert "not resolvable at this scale" not in PAGE.read_text()


def test_a_time_claim_layout_without_its_fields_is_one_line(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / tc.SPEC).write_text(yaml.safe_dump({"kind": "time_to_target", "source": "s"}))
    with pytest.raises(Exception, match="needs target, rows and columns"):
        tc.load_spec("x", tmp_path)


# ----------------------------------------------------------------------------- the clock's columns
def test_a_clocked_run_records_virtual_time_and_an_unclocked_one_does_not(tmp_path):
    """Three real in-process runs of the HLF classifier on 2 workers, 12 steps: two on 1 GbE with the
    committed HLF compute profile (virtual time is the same to the bit; a wall-clock column would not
    be), one without a cluster. About 9 s."""
    from pipeline.studies.results import run_metrics
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    manifest = write_hlf_shards(tmp_path / "f", tmp_path / "s", learnable=True)
    profile = "configs/clusters/profiles/hlf_adam_1thread.yaml"
    out = {}
    gbe1 = {"preset": "gbe1", "nodes": 2, "ranks_per_node": 1,
            "compute_profile": str(Path(tc.__file__).parents[2] / profile)}
    for name, cluster in (("gbe1", gbe1), ("gbe1_again", gbe1), ("none", {})):
        cfg = TrainConfig(manifest=str(manifest), output=str(tmp_path / name), checkpoint_dir=str(tmp_path / f"c{name}"),
                          model="hlf", launcher="inprocess", workers=2, batch_size=16, epochs=50, max_steps=12,
                          eval_every=4, lr=0.01, lr_scaling="none", warmup_epochs=0, progress=False,
                          checkpoint_every=0, tracking={"enabled": False}, cluster=cluster)
        train(cfg)
        out[name] = run_metrics(tmp_path / name, target=0.0)
    m = out["gbe1"]
    step_s = yaml.safe_load((Path(tc.__file__).parents[2] / profile).read_text())["compute_step_s"][8]
    # the compute profile's step at local batch 8 plus a ring allreduce of the gradients on 1 GbE
    assert m["virtual_s_per_step"] > step_s and m["virtual_s_per_step"] < step_s + 0.005
    assert m["virtual_s"] == pytest.approx(m["virtual_s_per_step"] * m["steps"])
    assert 0 < m["comm_share"] < 1 and m["inter_node_bytes"] > 0
    assert m["virtual_time_to_target_s"] <= m["virtual_s"]
    assert {k: out["gbe1_again"][k] for k in m if k.startswith("virtual") or k in ("comm_share", "inter_node_bytes")} \
        == {k: m[k] for k in m if k.startswith("virtual") or k in ("comm_share", "inter_node_bytes")}
    assert all(math.isnan(out["none"][k]) for k in ("virtual_s", "virtual_s_per_step", "virtual_time_to_target_s",
                                                    "comm_share", "inter_node_bytes"))


def test_a_compute_profile_is_read_from_its_file_and_a_missing_one_is_named(tmp_path):
    from pipeline.train.config import ClusterConfig

    f = tmp_path / "p.yaml"
    f.write_text("compute_step_s: {8: 0.002, 64: 0.01}\ncompute_source: measured here\n")
    c = ClusterConfig(preset="gbe10", compute_profile=str(f))
    assert c.step_seconds(8) == 0.002 and c.compute_source == "measured here"
    with pytest.raises(ConfigError, match="cluster.compute_profile=.*nope.yaml.*not found"):
        ClusterConfig(preset="gbe10", compute_profile=str(tmp_path / "nope.yaml"))
    f.write_text("compute_step_s: {8: 0.002}\n")
    with pytest.raises(ConfigError, match="p.yaml.*needs compute_step_s .* and compute_source"):
        ClusterConfig(preset="gbe10", compute_profile=str(f))
