"""The steps-to-result analysis (pipeline/studies/steps_to_result.py) on hand-built run records:
steps to a target, the best setting per batch, the normalisation, the regime rule and the verdicts."""
import math

import pytest

from pipeline.studies import steps_page as sp
from pipeline.studies import steps_to_result as s2r


def rec(batch, lr, momentum, accs, every=10, **train):
    """A run record whose validation accuracy is accs[i] at step (i + 1) * every."""
    return {"config": {"train": {"batch_size": batch, "lr": lr, "momentum": momentum, "lr_scaling": "none",
                                 "warmup_epochs": 0, **train}},
            "curve": [{"split": "val", "step": (i + 1) * every, "accuracy": a} for i, a in enumerate(accs)]
            + [{"split": "test", "step": len(accs) * every, "accuracy": 0.99}]}


def test_steps_to_target_is_the_first_validation_at_or_below_the_error():
    r = rec(16, 0.1, 0.0, [0.5, 0.85, 0.93, 0.88, 0.95])
    assert s2r.steps_to_target(r["curve"], 0.10) == 30      # 0.93 is the first >= 0.90
    assert s2r.steps_to_target(r["curve"], 0.15) == 20      # exactly at the target counts
    assert s2r.steps_to_target(r["curve"], 0.05) == 50
    assert s2r.steps_to_target(r["curve"], 0.01) is None    # the test split's 0.99 is not a validation


def test_best_per_batch_takes_the_fewest_steps_over_the_grid_per_family():
    recs = [rec(16, 0.1, 0.0, [0.5, 0.95]), rec(16, 0.3, 0.0, [0.95]), rec(16, 1.0, 0.0, [0.3, 0.3]),
            rec(16, 0.1, 0.9, [0.5, 0.5, 0.95]), rec(16, 0.03, 0.99, [0.2, 0.95]),
            rec(32, 0.1, 0.0, [0.2, 0.2])]
    best = s2r.best_per_batch(recs, 0.10)
    assert (best["sgd"][16].steps, best["sgd"][16].lr) == (10, 0.3)
    assert (best["sgd"][16].runs, best["sgd"][16].reached) == (3, 2)
    assert (best["momentum"][16].steps, best["momentum"][16].momentum) == (20, 0.99)
    assert 32 not in best["sgd"]                               # no setting reached it at B = 32


def test_a_setting_is_the_mean_over_its_seeds_and_counts_only_where_every_seed_reached():
    recs = [rec(16, 0.1, 0.0, [0.5, 0.95]), rec(16, 0.1, 0.0, [0.5, 0.5, 0.5, 0.95]),   # 20 and 40: mean 30
            rec(16, 0.3, 0.0, [0.95]), rec(16, 0.3, 0.0, [0.3, 0.3, 0.3, 0.3, 0.3])]   # one seed never reached
    p = s2r.best_per_batch(recs, 0.10)["sgd"][16]
    assert (p.steps, p.lr, p.seeds, p.runs, p.reached) == (30, 0.1, 2, 2, 1)


def test_linear_scaling_runs_are_not_part_of_the_tuned_curve():
    recs = [rec(16, 0.1, 0.9, [0.5, 0.95]), rec(16, 0.1, 0.9, [0.95], warmup_epochs=5, lr_scaling="linear")]
    assert s2r.best_per_batch(recs, 0.10)["momentum"][16].steps == 20


def pts(steps_by_batch):
    return {b: s2r.Point(b, s, 0.1, 0.0, 1, 1) for b, s in steps_by_batch.items()}


def test_normalised_divides_by_the_smallest_batch():
    n = s2r.normalised(pts({16: 1000, 32: 500, 64: 300}))
    assert n == {16: 1.0, 32: 0.5, 64: 0.3}
    assert s2r.normalised(pts({32: 400, 64: 100})) == {32: 1.0, 64: 0.25}


def test_regimes_perfect_then_diminishing_then_flat():
    # halving twice (slope -1), then -0.58 (diminishing), then about -0.07 and 0 (no benefit)
    p = pts({16: 4000, 32: 2000, 64: 1000, 128: 670, 256: 640, 512: 640})
    r = s2r.regimes(p, p)
    assert [d[3] for d in r.doublings] == [s2r.PERFECT, s2r.PERFECT, s2r.DIMINISHING, s2r.FLAT, s2r.FLAT]
    assert r.perfect_until == 64 and r.max_useful == 128 and not r.max_useful_ge and r.ordered
    assert r.doublings[2][2] == pytest.approx(math.log2(670 / 1000))


def test_regimes_thresholds_are_the_stated_slopes():
    # 2^0.85 = 1.802 and 2^0.15 = 1.110: a fall of 1.81x is perfect, 1.79x is not; 1.12x is diminishing,
    # 1.10x is no benefit
    assert s2r.classify(math.log2(1 / 1.81)) == s2r.PERFECT
    assert s2r.classify(math.log2(1 / 1.79)) == s2r.DIMINISHING
    assert s2r.classify(math.log2(1 / 1.12)) == s2r.DIMINISHING
    assert s2r.classify(math.log2(1 / 1.10)) == s2r.FLAT


def test_a_batch_that_never_reaches_the_target_ends_the_useful_range():
    p = pts({16: 800, 32: 400, 64: 200})
    r = s2r.regimes(p, [16, 32, 64, 128, 256])     # 128 and 256 ran but never reached the target
    assert r.max_useful == 64 and not r.max_useful_ge and r.perfect_until == 64


def test_a_curve_still_falling_at_the_largest_batch_gives_a_lower_bound():
    p = pts({16: 800, 32: 400, 64: 300})
    r = s2r.regimes(p, p)
    assert (r.max_useful, r.max_useful_ge, r.perfect_until) == (64, True, 32)


def test_regimes_that_go_back_are_not_ordered():
    p = pts({16: 800, 32: 780, 64: 390})           # no benefit, then perfect again
    assert not s2r.regimes(p, p).ordered


def test_a_reversal_through_a_point_of_one_seed_is_not_resolved():
    p = pts({16: 800, 32: 780, 64: 390})           # each point one seed: no spread known
    r = s2r.regimes(p, p)
    assert not r.ordered and not r.back_resolved and r.ses == [None, None]


def test_the_slope_error_comes_from_the_seeds_spread_and_the_validation_interval():
    # steps 100 at both batches, sd 10 over 4 seeds: var(log2 mean) = 0.1^2 / 4 / ln(2)^2 = 0.0052034 each;
    # sqrt(2 x 0.0052034) = 0.10201; a validation every 10 steps adds 10^2 / 12 to the run variance:
    # sqrt(100 + 8.333) = 10.408 -> 0.10618
    a, b = s2r.Point(16, 100, 0.1, 0.0, 1, 1, 4, 10.0, 0.0), s2r.Point(32, 100, 0.1, 0.0, 1, 1, 4, 10.0, 0.0)
    assert s2r.slope_se(a, b) == pytest.approx(0.10201, abs=1e-4)
    a.every = b.every = 10.0
    assert s2r.slope_se(a, b) == pytest.approx(0.10618, abs=1e-4)
    b.batch = 64                                   # over two doublings the slope's error halves
    assert s2r.slope_se(a, b) == pytest.approx(0.10618 / 2, abs=1e-4)
    assert s2r.slope_se(a, s2r.Point(32, 100, 0.1, 0.0, 1, 1)) is None


def test_the_verdicts_z_covers_every_slope_at_once():
    # Bonferroni, two-sided 95 %: Phi^-1(1 - 0.025 / k)
    assert s2r.family_z(1) == pytest.approx(1.95996, abs=1e-4)
    assert s2r.family_z(10) == pytest.approx(2.80703, abs=1e-4)
    assert s2r.family_z(60) == pytest.approx(3.34148, abs=1e-4)


def seeded_recs(steps_by_batch, every=1):
    """Momentum-0 records, one per seed: steps_by_batch maps a batch to its seeds' steps to 0.95."""
    return [rec(b, 0.1, 0.0, [0.5] * (s // every - 1) + [0.95], every=every)
            for b, seeds in steps_by_batch.items() for s in seeds]


def test_a_reversal_beyond_the_seeds_spread_disagrees_and_one_within_it_is_not_resolvable():
    # 16 -> 32 no benefit (slope about -0.03), then 32 -> 64 perfect (-1): tight seeds resolve it
    tight = s2r.curves("A", seeded_recs({16: [800, 810, 790], 32: [780, 790, 770], 64: [390, 400, 380]}), [0.1])
    c = next(c for c in tight if c.family == "sgd")
    assert c.points[32].seeds == 3 and c.points[32].sd == pytest.approx(10.0)
    assert not c.regimes.ordered and c.regimes.back_resolved
    v = {claim: (verdict, why) for claim, verdict, why in s2r.verdicts(tight, 3.16)}
    # 2 slopes at once: z = 2.24; -0.04 +- 0.03 (steepest -0.07: no benefit), -1 +- 0.05 (flattest -0.95: perfect)
    assert v["three regimes"] == ("disagrees", "A sgd at error 0.1: the regimes go back along the batch, beyond the "
                                  "seeds' spread (1 of 1 curves; z = 2.24 over 2 slopes)")
    # the same means, seeds spread wide: the slopes' intervals overlap across the classes
    wide = s2r.curves("A", seeded_recs({16: [400, 800, 1200], 32: [380, 780, 1180], 64: [190, 390, 590]}), [0.1])
    c = next(c for c in wide if c.family == "sgd")
    assert not c.regimes.ordered and not c.regimes.back_resolved
    v = dict((claim, verdict) for claim, verdict, _ in s2r.verdicts(wide, 3.16))
    assert v["three regimes"] == "not resolvable"


def test_the_validation_interval_alone_can_hide_a_reversal():
    # every seed reaches the target at the same validation (sd 0), 800 -> 800 -> 400 steps: no benefit,
    # then perfect. A validation every 100 steps leaves a run 100 / sqrt(12) = 28.9 steps uncertain:
    # slopes 0 +- 0.08 and -1 +- 0.13, resolved; every 400 steps: 0 +- 0.33 (steepest -0.33, diminishing)
    # and -1 +- 0.53 (flattest -0.47, diminishing), not resolved
    coarse = s2r.curves("A", seeded_recs({16: [800] * 3, 32: [800] * 3, 64: [400] * 3}, every=100), [0.1])
    c = next(c for c in coarse if c.family == "sgd")
    assert c.points[16].every == 100 and c.points[16].sd == 0
    assert not c.regimes.ordered and c.regimes.back_resolved
    assert [1.96 * se for se in c.regimes.ses] == pytest.approx([0.0833, 0.1317], abs=1e-3)
    coarser = s2r.curves("A", seeded_recs({16: [800] * 3, 32: [800] * 3, 64: [400] * 3}, every=400), [0.1])
    c = next(c for c in coarser if c.family == "sgd")
    assert not c.regimes.ordered and not c.regimes.back_resolved
    assert [1.96 * se for se in c.regimes.ses] == pytest.approx([0.3332, 0.5268], abs=1e-3)


def test_rate_rules_within_one_grid_step():
    # over 16 ... 1024 the rules part by more than one step: sqrt(64) = 8 > 3.16
    lin = {b: s2r.Point(b, 10, 0.01 * b / 16, 0.0, 1, 1) for b in (16, 32, 64, 128, 256, 512, 1024)}
    assert s2r.rate_rules(lin, 3.16) == {"linear": True, "sqrt": False, "constant": False}
    flat = {b: s2r.Point(b, 10, lr, 0.0, 1, 1) for b, lr in ((16, 0.1), (32, 0.3), (64, 0.1), (128, 0.1))}
    assert s2r.rate_rules(flat, 3.16)["constant"] is True
    assert s2r.rate_rules(flat, 3.16)["linear"] is False


def curve_recs(steps_sgd, steps_mom, every=1):
    """Records whose best runs reach accuracy 0.95 at exactly the given steps."""
    out = []
    for mom, steps in ((0.0, steps_sgd), (0.9, steps_mom)):
        for b, s in steps.items():
            out.append(rec(b, 0.1 * b / 16, mom, [0.5] * (s - 1) + [0.95], every=every))
    return out


def test_verdicts_momentum_extends_perfect_scaling_and_one_workload_is_not_enough():
    sgd = {16: 64, 32: 32, 64: 30, 128: 30}
    mom = {16: 64, 32: 32, 64: 16, 128: 15}
    cs = s2r.curves("W", curve_recs(sgd, mom), [0.10])
    v = {claim: verdict for claim, verdict, _ in s2r.verdicts(cs, 3.16)}
    assert v["momentum extends perfect scaling"] == "agrees"
    assert v["three regimes"] == "not resolvable"           # one workload; the claim is across problems
    assert v["maximum useful batch varies"] == "not resolvable"
    assert v["no simple rule for the best rate"] == "disagrees"  # every best rate is linear in B here


def test_verdicts_across_two_workloads():
    a = s2r.curves("A", curve_recs({16: 64, 32: 32, 64: 20, 128: 19}, {16: 64, 32: 32, 64: 16, 128: 15}), [0.1])
    b = s2r.curves("B", curve_recs({16: 64, 32: 32, 64: 16, 128: 8, 256: 4, 512: 3, 1024: 3},
                                   {16: 64, 32: 32, 64: 16, 128: 8, 256: 4, 512: 2, 1024: 2}), [0.1])
    v = {claim: verdict for claim, verdict, _ in s2r.verdicts(a + b, 3.16)}
    assert v["three regimes"] == "agrees"
    assert v["maximum useful batch varies"] == "agrees"          # 64 against 512
    same = s2r.verdicts(a + s2r.curves("C", curve_recs({16: 64, 32: 32, 64: 20, 128: 19},
                                                       {16: 64, 32: 32, 64: 16, 128: 15}), [0.1]), 3.16)
    assert dict((c, v) for c, v, _ in same)["maximum useful batch varies"] == "disagrees"


def write_study(root, study, records, targets=(0.10,)):
    import json

    (root / study).mkdir(parents=True)
    (root / study / "steps.yaml").write_text(f"workload: W\ntargets: {list(targets)}\ngrid_step: 3.16\n")
    for i, r in enumerate(records):
        d = root / study / f"cell{i}"
        d.mkdir()
        (d / "seed_0.json").write_text(json.dumps({"format": 2, "metrics": {}, **r}))


def test_the_page_region_and_its_figure_come_from_the_records(tmp_path):
    root = tmp_path / "results"
    write_study(root, "s2r", curve_recs({16: 64, 32: 32, 64: 30}, {16: 64, 32: 40, 64: 16}))
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    text = "intro\n<!-- results-steps: s2r -->\nold\n<!-- /results-steps -->\nend\n"
    new = sp.regenerate(text, root, page)
    assert "old" not in new and new.startswith("intro\n") and new.endswith("<!-- /results-steps -->\nend\n")
    assert "| 64 | 30 | 0.469 | 0.4 (1 setting run) | 16 | 0.25 | 0.4, 0.9 (1 setting run) |" in new
    assert "| momentum extends perfect scaling | disagrees | W error 0.1: SGD to 32, momentum to 16 |" in new
    assert ("| three regimes | not resolvable | 1 of 2 curves go back along the batch, none beyond the seeds' "
            "spread (no slope's spread known; 1 through a point of one seed) |") in new
    stale = sp.stale_figures(new, root, page)
    assert [p.name for p, _ in stale] == ["results_s2r.png"]
    sp.write_figures(stale)
    assert sp.stale_figures(new, root, page) == []
    write_study(root, "other", [])                    # a record changes: the figure is stale again
    (root / "s2r" / "cell0" / "seed_0.json").unlink()
    assert len(sp.stale_figures(new, root, page)) == 1


def test_a_study_without_its_steps_file_is_one_line(tmp_path):
    from pipeline.errors import BadInputError

    (tmp_path / "s2r").mkdir()
    with pytest.raises(BadInputError, match=r"s2r/steps.yaml: not found"):
        sp.load("s2r", tmp_path)


def test_the_tiny_size_overrides_a_variants_step_budget():
    """The shipped steps-to-result studies set a step budget per batch in their variants; at the tiny
    size (tests/test_studies.py runs every shipped study so) the tiny budget must win."""
    from pathlib import Path

    from pipeline.config import load_config
    from pipeline.studies import tiny
    from pipeline.studies.grid import plan_study
    from pipeline.studies.spec import StudyConfig

    repo = Path(__file__).resolve().parents[1]
    for name in ("steps_to_result_lenet", "steps_to_result_hlf"):
        spec = tiny.shrink(load_config(StudyConfig, repo / "configs" / "experiments" / f"{name}.yaml"))
        plan = plan_study(spec)
        assert len(plan.cells) == 2
        for (_, _), cfg in plan.configs.items():
            assert (cfg.train.max_steps, cfg.train.eval_every) == (4, 2)


def test_the_results_command_writes_the_steps_region_and_its_figure(tmp_path):
    """jobs.results_tables (pipeline/studies/tables.py) regenerates results-steps regions and draws
    their figures with the page's tables; check mode fails until then."""
    from pipeline.errors import PipelineError
    from pipeline.studies import tables

    root = tmp_path / "results"
    write_study(root, "s2r", curve_recs({16: 64, 32: 32}, {16: 64, 32: 32}))
    page = tmp_path / "results.md"
    page.write_text("<!-- results-steps: s2r -->\n<!-- /results-steps -->\n")
    cfg = dict(page=str(page), results=str(root))
    with pytest.raises(PipelineError, match="out of date"):
        tables.results_tables(tables.ResultsTablesConfig(check=True, **cfg))
    out = tables.results_tables(tables.ResultsTablesConfig(**cfg))
    assert out["figures"] == [str(tmp_path / "figures" / "results_s2r.png")]
    assert "| 32 | 32 | 0.5 | 0.2 (1 setting run) | 32 | 0.5 | 0.2, 0.9 (1 setting run) |" in page.read_text()
    assert not tables.results_tables(tables.ResultsTablesConfig(check=True, **cfg))["rewritten"]


def test_the_section_names_each_doublings_slope_and_class():
    recs = curve_recs({16: 64, 32: 32, 64: 30}, {16: 64, 32: 32, 64: 16})
    text = sp.render("W", recs, [0.10], 3.16)
    assert "- sgd: perfect scaling up to B = 32; maximum useful batch 32; " in text
    assert "16->32 -1.00 ± ? (perfect), 32->64 -0.09 ± ? (no benefit)" in text  # one seed: spread unknown
    assert "- momentum: perfect scaling up to B = 64; maximum useful batch >= 64;" in text
    text = sp.render("W", curve_recs({16: 64, 32: 40}, {16: 64, 32: 40}), [0.10], 3.16)
    assert "- sgd: no doubling of perfect scaling from B = 16; maximum useful batch >= 32;" in text


def test_a_batch_run_only_by_the_other_family_is_not_a_miss():
    recs = curve_recs({16: 64, 32: 32}, {16: 64, 32: 32}) + [rec(64, 0.1, 0.0, [0.2, 0.2])]   # SGD missed at 64
    cs = {c.family: c for c in s2r.curves("W", recs, [0.10])}
    assert cs["sgd"].regimes.max_useful == 32 and not cs["sgd"].regimes.max_useful_ge
    assert cs["momentum"].regimes.max_useful == 32 and cs["momentum"].regimes.max_useful_ge   # 64 not run


def test_a_batch_without_a_point_says_how_many_settings_ran():
    recs = [rec(16, 0.1, 0.0, [0.95]), rec(32, 0.1, 0.0, [0.2]), rec(32, 0.3, 0.0, [0.2]),
            rec(64, 0.1, 0.0, [0.5, 0.95]), rec(64, 0.3, 0.0, [0.95]), rec(64, 1.0, 0.0, [0.1])]
    text = sp.render("W", recs, [0.10], 3.16)
    assert "| 64 | 10 | 1 | 0.3 (best of 3) | not run |  |  |" in text
    assert "| 32 | not reached (2 settings run) |  |  | not run |  |  |" in text
    assert "| 16 | 10 | 1 | 0.1 (1 setting run) | not run |  |  |" in text


def test_a_span_over_batches_not_run_is_not_classified():
    p = pts({16: 1000, 256: 100})                 # 32 ... 128 not run yet (a sitting)
    r = s2r.regimes(p, [16, 256])
    assert r.doublings == [(16, 256, pytest.approx(math.log2(0.1) / 4), s2r.GAP)]
    assert (r.perfect_until, r.max_useful, r.max_useful_ge) == (16, 256, True)


def test_momentum_is_not_compared_with_sgd_from_a_different_smallest_batch():
    recs = curve_recs({16: 64, 32: 40}, {32: 40, 64: 20})       # momentum never reached it at 16
    recs.append(rec(16, 0.1, 0.9, [0.2]))
    (v,) = [x for x in s2r.verdicts(s2r.curves("W", recs, [0.10]), 3.16) if x[0].startswith("momentum")]
    assert v[1] == "not resolvable" and "(from different batches)" in v[2]


def test_the_warm_up_row_points_to_the_workloads_warm_up_study_only_where_it_has_records(tmp_path):
    """Goyal's warm-up has a study of its own per workload (``<study>_warmup``, its own table and verdict):
    the steps table's row says where that verdict is, and "not run" for a workload without its records."""
    root = tmp_path / "results"
    write_study(root, "s2r", curve_recs({16: 64, 32: 32}, {16: 64, 32: 40}))
    page = tmp_path / "docs" / "results.md"
    text = "<!-- results-steps: s2r -->\n<!-- /results-steps -->\n"
    row = "| linear scaling with gradual warm-up (Goyal: 8k 23.74 ± 0.09 against 24.84 ± 0.37 without) | below | "
    assert row + "W: not run |" in sp.regenerate(text, root, page)
    write_study(root, "s2r_warmup", curve_recs({256: 30}, {256: 30}))
    assert row + "W: `s2r_warmup`, its verdict below |" in sp.regenerate(text, root, page)
