"""The verdict rule of docs/results.md (pipeline/studies/verdicts.py) and the verdicts, figures and
quoted steps the page holds, against the committed run records (results/)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from pipeline.studies.verdicts import AGREES, DISAGREES, UNRESOLVED, Comparison, judge

REPO = Path(__file__).resolve().parents[1]


def _cmp(claim: str, effect: float, **kw) -> Comparison:
    return Comparison(label="x", cell={"row": "a", "column": "c"}, against={"row": "b", "column": "c"},
                      claim=claim, source="s", source_effect=effect, **kw)


def test_a_claimed_effect_is_judged_by_the_one_sided_interval_and_the_one_tailed_p():
    base = [90.0, 90.4, 89.8, 90.2]
    lower = [89.0, 89.3, 88.8, 89.1]            # about 1 p.p. below, tight
    r = judge(lower, base, _cmp("effect", -1.0))
    assert r["verdict"] == AGREES
    assert r["p"] == pytest.approx(stats.ttest_ind(lower, base, equal_var=False, alternative="less").pvalue)
    # the source claims 5 p.p. below: far outside our interval, although ours has its direction
    assert judge(lower, base, _cmp("effect", -5.0))["verdict"] == DISAGREES
    # the source claims a gain: ours is the opposite at p < 0.05
    r = judge(lower, base, _cmp("direction", +0.5))
    assert r["verdict"] == DISAGREES and r["p_opposite"] < 0.05
    # a loss too noisy to tell: not resolvable, with the power stated
    noisy = [88.0, 91.5, 89.0, 92.0]
    r = judge(noisy, base, _cmp("effect", -0.3))
    assert r["verdict"] == UNRESOLVED and r["why"] == "low power" and 0 < r["power"] < 0.8


def test_a_null_agrees_only_with_power_for_the_source_effect():
    rng = np.random.default_rng(0)
    a, b = list(90 + 0.05 * rng.standard_normal(5)), list(90 + 0.05 * rng.standard_normal(5))
    assert judge(a, b, _cmp("none", 0.5))["verdict"] == AGREES          # tight: 0.5 p.p. would show
    wide_a, wide_b = list(90 + 1.0 * rng.standard_normal(3)), list(90 + 1.0 * rng.standard_normal(3))
    r = judge(wide_a, wide_b, _cmp("none", 0.5))
    assert r["verdict"] == UNRESOLVED and r["power"] < 0.3
    far = [x + 3 for x in a]
    assert judge(far, b, _cmp("none", 0.5))["verdict"] == DISAGREES     # a difference the source does not find


def test_runs_at_chance_are_counted_and_never_averaged_into_a_test():
    base = [90.0, 90.4, 89.8]
    r = judge([10.05, 83.93, 9.82], base, _cmp("effect", -1.5), chance_below=20)
    assert r["collapsed"] == (2, 0) and r["verdict"] == UNRESOLVED and np.isnan(r["p"])
    r = judge([10.0, 88.0, 88.4, 88.2], base, _cmp("effect", -1.5), chance_below=20)
    assert r["collapsed"] == (1, 0) and r["diff"] == pytest.approx(np.mean([88.0, 88.4, 88.2]) - np.mean(base))


def test_cells_not_run_or_with_one_run_say_so_not_runs_at_chance():
    from pipeline.studies.verdicts import _reason

    r = judge([], [], _cmp("effect", -1.5), chance_below=20)
    assert r["verdict"] == UNRESOLVED and _reason(r) == "not resolvable (not run yet)"
    r = judge([88.0], [90.0, 90.4], _cmp("effect", -1.5), chance_below=20)
    assert _reason(r) == "not resolvable (fewer than 2 runs in a cell: 1 and 2)"
    r = judge([10.0, 88.0], [90.0, 90.4], _cmp("effect", -1.5), chance_below=20)
    assert _reason(r) == "not resolvable (1 of 2 and 0 of 2 runs at chance)"


def test_an_unresolved_direction_claim_says_whether_the_interval_holds_the_source_effect():
    """A direction claim with p >= 0.05 and power >= 0.8: the reason names what the interval holds. Here the
    one-sided upper bound is about +0.17 p.p.: the source's +0.20 is outside it, its +0.10 inside."""
    from pipeline.studies.verdicts import _reason

    a, b = [94.60, 94.70, 94.68], [94.55, 94.72, 94.62]
    out = judge(a, b, _cmp("direction", 0.20))
    assert out["verdict"] == UNRESOLVED and out["bound"] < 0.20 and out["power"] >= 0.8
    assert "outside our interval" in _reason(out) and "holds the source's effect" not in _reason(out)
    inside = dict(out, bound=0.25)         # the same result with a wider interval: +0.20 inside it
    assert "the interval holds the source's effect" in _reason(inside)


def test_the_power_is_the_rejection_rate_of_the_test_at_the_source_effect():
    """The power judge() states is what repeated experiments at our spreads and sizes would give: the
    share of 20,000 simulated pairs whose one-tailed Welch test rejects at 0.05."""
    a, b = [88.0, 88.9, 87.6, 88.4, 88.1], [88.3, 87.2, 88.8, 87.9, 88.6]
    r = judge(a, b, _cmp("effect", 0.8))
    rng = np.random.default_rng(1)
    sa, sb = np.std(a, ddof=1), np.std(b, ddof=1)
    xa = 0.8 + sa * rng.standard_normal((20000, 5))
    xb = sb * rng.standard_normal((20000, 5))
    sim = np.mean(stats.ttest_ind(xa, xb, axis=1, equal_var=False, alternative="greater").pvalue < 0.05)
    assert r["power"] == pytest.approx(sim, abs=0.03)


def _verdict_rows(study: str) -> dict[str, list[str]]:
    text = (REPO / "docs" / "results.md").read_text()
    region = re.search(rf"<!-- results-verdict: {study} -->\n(.*?)<!-- /results-verdict -->", text, re.S).group(1)
    return {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in region.splitlines() if ln.startswith("| ") and not ln.startswith(("| comparison", "| ---"))}


def _vals(study: str, metric: str = "val_accuracy", **factors) -> list[float]:
    out = []
    for f in sorted((REPO / "results" / study).glob("*/seed_*.json")):
        rec = json.loads(f.read_text())
        if all(json.dumps(rec["factors"].get(k), sort_keys=True) == json.dumps(v, sort_keys=True)
               for k, v in factors.items()):
            out.append(100 * rec["metrics"][metric])
    return out


def test_the_page_verdicts_are_the_rule_applied_to_the_records():
    """Numbers the page's verdicts quote, recomputed here from the records with scipy: E3.2.1's one-tailed
    p at H = 4 and its collapsed H = 8 runs; E3.2.4's condition (disjoint accuracy falls with L_W) and
    its comparison at L_W = 128, S_H = 1; Table 4.3 not resolvable while its runs still rise."""
    base, h4, h8 = (_vals("e3_2_1_households", variant=v) for v in ("arsgd", "H4_LW128", "H8_LW128"))
    rows = _verdict_rows("e3_2_1_households")
    p = stats.ttest_ind(h4, base, equal_var=False, alternative="less").pvalue
    assert rows["H = 4 against the baseline"][5] == f"{p:.3g}" and rows["H = 4 against the baseline"][-1] == "agrees"
    at_chance = sum(v <= 20 for v in h8)
    assert rows["H = 8 against the baseline"][-2] == f"{at_chance} of {len(h8)}, 0 of {len(base)}"
    assert rows["H = 8 against the baseline"][-1].startswith("not resolvable")

    lw = {w: _vals("e3_2_4_household_overlap", variant=f"LW{w}", **{"shard.household_shards": sh})
          for w, sh in ((32, 8), (128, 8))}
    rows = _verdict_rows("e3_2_4_household_overlap")
    cond = [v for k, v in rows.items() if k.endswith("(condition)")][0]
    p = stats.ttest_ind(lw[128], lw[32], equal_var=False, alternative="less").pvalue
    assert cond[5] == f"{p:.3g}" and cond[2] == f"{np.mean(lw[128]) - np.mean(lw[32]):+.2f}"
    s1 = _vals("e3_2_4_household_overlap", variant="LW128", **{"shard.household_shards": 1})
    row = rows["L_W = 128: S_H = 1 against S_H = 8"]
    assert row[2] == f"{np.mean(s1) - np.mean(lw[128]):+.2f}"

    for name, row in _verdict_rows("llf_gru_table_4_3").items():
        assert row[-1].startswith("not resolvable (not converged"), name


def test_the_prose_after_the_verdicts_quotes_the_records():
    """E3.2.1 with BatchNorm: the baseline and the two losses; Table 4.2 to convergence: AR-SGD's best
    validation and where it falls, and the range of the other cells' best."""
    text = (REPO / "docs" / "results.md").read_text()
    base, h4, h8 = (_vals("e3_2_1_households_bn", variant=v) for v in ("arsgd", "H4_LW128", "H8_LW128"))
    sec = text[text.index("#### E3.2.1 with BatchNorm"):text.index("### E3.2.4")]
    sec = sec[sec.index("<!-- /results-verdict -->"):]
    assert f"({np.mean(base):.2f} ± {np.std(base, ddof=1):.2f} against 91.52" in sec
    assert f"{np.mean(base) - np.mean(h4):.2f} p.p. at H = 4" in sec
    assert f"{np.mean(base) - np.mean(h8):.2f} p.p. at H = 8" in sec

    best, final, steps = {}, {}, {}
    for f in sorted((REPO / "results" / "hlf_table_4_2_converged").glob("*/seed_*.json")):
        rec = json.loads(f.read_text())
        vals = [c for c in rec["curve"] if c["split"] == "val"]
        top = max(vals, key=lambda c: c["accuracy"])
        v = rec["factors"]["variant"]
        best.setdefault(v, []).append(100 * top["accuracy"])
        steps.setdefault(v, []).append(top["step"])
        final.setdefault(v, []).append(100 * rec["metrics"]["val_accuracy"])
    sec = text[text.index("#### Table 4.2 to convergence"):text.index("### Migliorini Table 4.3")]
    sec = sec[sec.index("<!-- /results-verdict -->"):]
    ar = best.pop("arsgd")
    assert f"{np.mean(ar):.2f} ±\n{np.std(ar, ddof=1):.2f} % at steps {min(steps['arsgd'])}-{max(steps['arsgd'])}" in sec
    others = [np.mean(v) for v in best.values()]
    assert f"({min(others):.2f}-{max(others):.2f} %, each at step {min(min(v) for k, v in steps.items() if k != 'arsgd'):,} or later)" in sec
    assert f"falls to {np.mean(final['arsgd']):.2f} % at the end" in sec


def test_the_run_plan_quotes_the_recorded_steps():
    """The run plan's "steps per run" of each study with records holds exactly the smallest and the
    largest step count of its records (the page once said 6,736 where every run had 6,720)."""
    text = (REPO / "docs" / "results.md").read_text()
    plan = text[text.index("## Run plan"):]
    for line in plan.splitlines():
        m = re.match(r"\| `(\w+)` \| [^|]+ \| ([^|]+) \|", line)
        if not m or not (REPO / "results" / m.group(1)).is_dir():
            continue
        steps = {int(json.loads(f.read_text())["metrics"]["steps"])
                 for f in (REPO / "results" / m.group(1)).glob("*/seed_*.json")}
        quoted = {int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*", m.group(2).replace("B = 8192", "")
                                                                .replace("B = 256", ""))}
        assert quoted == {min(steps), max(steps)} or quoted == steps, (m.group(1), quoted, sorted(steps))


def test_a_figure_is_redrawn_when_its_records_change_and_check_fails_until_then(tmp_path):
    """The figure of a study follows its records: written by the page's command, identical when drawn
    again from the same records, and stale (check fails naming it) after a record's curve changes."""
    from pipeline.errors import PipelineError
    from pipeline.studies import tables

    root = tmp_path / "results"
    shutil.copytree(REPO / "results" / "e3_2_1_households", root / "e3_2_1_households")
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    page.write_text("<!-- results-table: e3_2_1_households -->\n<!-- /results-table -->\n"
                    "<!-- results-verdict: e3_2_1_households -->\n<!-- /results-verdict -->\n")
    cfg = tables.ResultsTablesConfig(page=str(page), results=str(root))
    out = tables.results_tables(cfg)
    png = tables.figure_path(page, "e3_2_1_households")
    assert out["figures"] == [str(png)] and "figures/results_e3_2_1_households.png" in page.read_text()
    first = png.read_bytes()
    png.unlink()
    tables.results_tables(cfg)
    assert png.read_bytes() == first                     # deterministic: the same bytes from the same records
    assert not tables.results_tables(cfg.model_copy(update={"check": True}))["rewritten"]
    rec = sorted((root / "e3_2_1_households").glob("H4_*/seed_0.json"))[0]
    doc = json.loads(rec.read_text())
    doc["curve"][0]["accuracy"] += 0.01                  # a curve point only: the tables stay the same
    rec.write_text(json.dumps(doc))
    with pytest.raises(PipelineError, match="results_e3_2_1_households.png is out of date"):
        tables.results_tables(cfg.model_copy(update={"check": True}))
    assert png.read_bytes() == first                     # check never writes


def _warmup_runs(study: str) -> tuple[dict, dict]:
    """(batch, warm-up epochs) -> the final and the best validation accuracies (%) of a warm-up study's runs."""
    fin, best = {}, {}
    for f in sorted((REPO / "results" / study).glob("*/seed_*.json")):
        rec = json.loads(f.read_text())
        k = (int(rec["factors"]["variant"][1:]), rec["factors"]["train.warmup_epochs"])
        fin.setdefault(k, []).append(100 * rec["metrics"]["val_accuracy"])
        best.setdefault(k, []).append(100 * max(c["accuracy"] for c in rec["curve"] if c["split"] == "val"))
    return fin, best


def test_the_warm_up_prose_quotes_the_records():
    """Goyal's warm-up on the HLF classifier: the spread of the k = 4, 8 cells around B = 256, the runs at
    chance at k = 16, 32, and their best validation with and without the warm-up."""
    text = (REPO / "docs" / "results.md").read_text()
    sec = text[text.index("#### Linear scaling with and without gradual warm-up"):text.index("### CIFAR-10 and ResNet-20")]
    sec = " ".join(sec[sec.index("<!-- /results-verdict -->"):].split())
    fin, best = _warmup_runs("steps_to_result_hlf_warmup")
    base = np.mean(fin[(256, 0)])
    spread = max(abs(np.mean(fin[(b, w)]) - base) for b in (1024, 2048) for w in (0, 5))
    assert f"within {spread:.2f} p.p. of B = 256's {base:.2f} %" in sec
    chance = {w: sum(v <= 55 for b in (4096, 8192) for v in fin[(b, w)]) for w in (0, 5)}
    assert f"{chance[0]} of 6 runs without the warm-up and {chance[5]} of 6 with it end at chance" in sec
    assert (f"averages {np.mean(best[(4096, 5)]):.2f} % at 4,096 and {np.mean(best[(8192, 5)]):.2f} % at 8,192 with it, "
            f"against {np.mean(best[(4096, 0)]):.2f} % and {np.mean(best[(8192, 0)]):.2f} % without") in sec


def test_the_steps_prose_on_the_flat_hlf_curves_holds_on_the_records():
    """The paragraph under the steps tables: where the HLF curves flatten (B >= 512 at error 0.06), every
    run of each batch's best setting reaches the target within the first fifth of its 100 validations."""
    from pipeline.studies import steps_page
    from pipeline.studies import steps_to_result as s2r

    text = " ".join((REPO / "docs" / "results.md").read_text().split())
    assert ("Where the curves flatten (B >= 512 at error 0.06) every run that counts reaches the target within "
            "the first fifth of its validations") in text
    _, _, _, recs = steps_page.load("steps_to_result_hlf", REPO / "results")
    checked = 0
    for pts in s2r.best_per_batch(recs, 0.06).values():
        for b, p in pts.items():
            for r in recs:
                if b >= 512 and s2r.is_tuned(r) and s2r.run_settings(r) == (b, p.lr, p.momentum):
                    assert s2r.steps_to_target(r["curve"], 0.06) <= 20 * r["config"]["train"]["eval_every"]
                    checked += 1
    assert checked == 2 * 5 * 3      # two families, five batches, three seeds


def test_a_panel_whose_runs_are_all_at_chance_says_so_instead_of_an_empty_legend(tmp_path):
    """A cell whose every run is at chance has no curve: its panel names it in words (matplotlib warned
    of an empty legend and drew a blank panel)."""
    import warnings

    from pipeline.report.results_figures import draw

    blank = {"label": "no warm-up; 3 at chance", "n": 0, "steps": [], "mean": [], "std": [], "source": None}
    drawn = {"label": "gradual warm-up", "n": 3, "steps": [1, 2], "mean": [50.0, 60.0], "std": [1.0, 1.0],
             "source": None}
    data = {"title": "t", "ylabel": "validation accuracy (%)",
            "panels": [{"title": "B = 8192", "lines": [blank, dict(blank, label="gradual warm-up; 3 at chance")]},
                       {"title": "B = 4096", "lines": [blank, drawn]}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # the empty legend's UserWarning fails the test
        draw(data, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_the_lenet_warm_up_prose_quotes_the_records():
    """Goyal's warm-up on LeNet-5: the k = 8 cells against B = 256, the runs at chance at k = 16, 32, and
    their best validation with and without the warm-up."""
    text = (REPO / "docs" / "results.md").read_text()
    head = "#### Linear scaling with and without gradual warm-up (Goyal et al.), LeNet-5"
    sec = text[text.index(head):text.index("### CIFAR-10 and ResNet-20")]
    sec = " ".join(sec[sec.index("<!-- /results-verdict -->"):].split())
    fin, best = _warmup_runs("steps_to_result_lenet_warmup")
    assert f"below B = 256's {np.mean(fin[(256, 0)]):.2f} %" in sec
    assert (f"{np.mean(fin[(2048, 2)]):.2f} % with the warm-up and {np.mean(fin[(2048, 0)]):.2f} % without" in sec
            and f"ended at {min(fin[(2048, 0)]):.2f} %" in sec)
    row = next(ln for ln in text[text.index(head):].splitlines() if ln.startswith("| 2048: gradual warm-up against"))
    power = row.split(" | ")[8]                          # the generated row's power column
    assert f"in Goyal's direction but at power {power}" in sec, row
    at_chance = sum(v <= 20 for b in (4096, 8192) for w in (0, 2) for v in fin[(b, w)])
    assert f"{at_chance} of 12 runs end at chance, with the warm-up and without" in sec
    assert (f"averages {np.mean(best[(4096, 2)]):.2f} % at 4,096 and {np.mean(best[(8192, 2)]):.2f} % at 8,192 with "
            f"it, against {np.mean(best[(4096, 0)]):.2f} % and {np.mean(best[(8192, 0)]):.2f} % without") in sec
