"""Studies (jobs/experiment.py): a tiny study end to end on the real digits through the real stages,
its statistics recomputed independently from results.parquet, its MLflow store, resuming, and
bad study files. Plain training runs logged to MLflow (jobs/train.py --tracking.enabled true)."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as sps

from jobs import experiment

METRICS = ["test_accuracy", "best_val_accuracy", "time_to_target_s", "samples_per_s"]
TINY_TRAIN = {"launcher": "local", "epochs": 1, "max_steps": 30, "eval_every": 10, "batch_size": 32,
              "progress": False, "warmup_epochs": 0, "checkpoint_every": 0}


def tiny_study(tmp: Path, name: str = "tiny", **over) -> dict:
    doc = {
        "name": name,
        "workflow": "images",
        "fixed": {"workers": 1, "ingest.source": "sklearn_digits", "shard.row_group_rows": 64,
                  **{f"train.{k}": v for k, v in TINY_TRAIN.items()}},
        "factors": {"grid": {"train.lr": [0.003, 0.03]}},
        "seeds": 2,
        "baseline": {"train.lr": 0.003},
        "metrics": METRICS,
        "target_accuracy": 0.2,
        "output": str(tmp / name),
    }
    doc.update(over)
    return doc


def write_yaml(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def finished_study(spark, tmp_path_factory):
    """The tiny study (2 cells x 2 seeds), run once through jobs/experiment.py."""
    tmp = tmp_path_factory.mktemp("study")
    # the digits dataset and its shards are cached by config in a directory shared with test_tune.py
    cfg = write_yaml(tmp / "tiny.yaml", tiny_study(tmp, data_dir=str(tmp_path_factory.getbasetemp() / "studies_data"),
                                                   records=str(tmp / "records")))
    assert experiment.main(["--config", str(cfg)]) == 0
    return cfg, tmp / "tiny"


def _mlflow(out: Path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"file://{out / 'mlruns'}")


def _report_rows(md: str, metric: str) -> dict[str, list[str]]:
    section = md.split(f"\n## {metric}\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| cell")]
    return {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in rows}


def _curve(path: Path) -> pd.DataFrame:
    return pd.DataFrame([json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()])


def _close(text: str, value: float) -> bool:
    if math.isnan(value):
        return text == "-"
    return math.isclose(float(text), value, rel_tol=1e-3, abs_tol=1e-12)


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_study_statistics_equal_a_recomputation(finished_study, monkeypatch):
    cfg, out = finished_study
    df = pd.read_parquet(out / "results.parquet")
    assert len(df) == 4 and sorted(zip(df["train.lr"], df["seed"])) == [(0.003, 0), (0.003, 1), (0.03, 0), (0.03, 1)]
    assert df["test_accuracy"].between(0, 1).all() and (df["samples_per_s"] > 0).all()
    assert (df["steps"] == 30).all()
    # one dataset and one shard layout, shared by the four runs
    data = Path(yaml.safe_load(cfg.read_text())["data_dir"])
    assert len(list(data.glob("ingest-*"))) == 1 and len(list(data.glob("shard-*"))) == 1
    assert {json.loads((Path(r) / "run.json").read_text())["train"]["manifest"] for r in df["run_dir"]} == {
        str(next(data.glob("shard-*")) / "manifest.json")}

    stats = pd.read_parquet(out / "stats.parquet")
    md = (out / "report.md").read_text()
    base = df[df["train.lr"] == 0.003]
    assert set(base["cell"]) == {"lr=0.003"}
    for metric in METRICS:
        rows = _report_rows(md, metric)
        b = base[metric].dropna().to_numpy()
        for cell, g in df.groupby("cell"):
            x = g[metric].dropna().to_numpy()
            mean = x.mean() if len(x) else math.nan
            sd = x.std(ddof=1) if len(x) > 1 else math.nan
            if len(x) > 1 and sd > 0:
                lo, hi = sps.t.interval(0.95, len(x) - 1, loc=mean, scale=sps.sem(x))
            else:
                lo = hi = mean if len(x) > 1 else math.nan
            p = math.nan
            if cell != "lr=0.003" and len(x) > 1 and len(b) > 1 and (x.std() > 0 or b.std() > 0):
                p = sps.ttest_ind(x, b, equal_var=False).pvalue
            s = stats[(stats["cell"] == cell) & (stats["metric"] == metric)].iloc[0]
            assert s["n"] == len(x) and s["n_runs"] == 2
            for got, want in ((s["mean"], mean), (s["std"], sd), (s["ci_low"], lo), (s["ci_high"], hi),
                              (s["p_value"], p)):
                assert (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=1e-9), (metric, cell)
            n_txt, mean_sd, ci, p_txt = rows[cell]
            assert n_txt == (str(len(x)) if len(x) == 2 else f"{len(x)} of 2")
            m_txt, sd_txt = mean_sd.split(" ± ")
            assert _close(m_txt, mean) and _close(sd_txt, sd), (metric, cell, mean_sd)
            if not math.isnan(lo):
                lo_txt, hi_txt = ci.strip("[]").split(", ")
                assert _close(lo_txt, lo) and _close(hi_txt, hi)
            # the report prints p with 3 significant digits: the same Welch test gives the same text
            assert p_txt == ("baseline" if cell == "lr=0.003" else "-" if math.isnan(p) else f"{p:.3g}"), (metric, p)
    # time to target = wall time of the first validation at or above the target
    for r in df.itertuples():
        vals = [rec for rec in _curve(Path(r.run_dir) / "train" / "metrics.jsonl").to_dict("records")
                if rec["split"] == "val"]
        hit = [rec["wall_s"] for rec in vals if rec["accuracy"] >= 0.2]
        assert (math.isnan(r.time_to_target_s) and not hit) or r.time_to_target_s == hit[0]
    for png in ("plots/learning_curves.png",):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_study_mlflow_store_holds_parent_and_children(finished_study, monkeypatch):
    _, out = finished_study
    c = _mlflow(out, monkeypatch)
    exp = c.get_experiment_by_name("tiny")
    runs = c.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted((r.data.params["cell"], r.data.params["seed"]) for r in kids) == [
        ("lr=0.003", "0"), ("lr=0.003", "1"), ("lr=0.03", "0"), ("lr=0.03", "1")]
    df = pd.read_parquet(out / "results.parquet")
    for k in kids:
        row = df[(df["cell"] == k.data.params["cell"]) & (df["seed"] == int(k.data.params["seed"]))].iloc[0]
        assert k.data.params["factor.train.lr"] == str(row["train.lr"])
        assert math.isclose(k.data.metrics["final_test_accuracy"], row["test_accuracy"])
        curve = _curve(Path(row["run_dir"]) / "train" / "metrics.jsonl")
        val = curve[curve["split"] == "val"]
        hist = c.get_metric_history(k.info.run_id, "val_accuracy")
        assert [(h.step, h.value) for h in sorted(hist, key=lambda h: h.step)] == list(zip(val["step"], val["accuracy"]))
        assert {"metrics.jsonl", "summary.json", "learning_curve.png"} <= {a.path for a in c.list_artifacts(k.info.run_id)}
    assert {"report.md", "results.parquet"} <= {a.path for a in c.list_artifacts(parent.info.run_id)}


@pytest.mark.slow
@pytest.mark.e2e
def test_resuming_a_half_finished_study_runs_only_the_missing_runs(finished_study, monkeypatch):
    """The state a study killed during its third run leaves behind: runs 1-2 finished and logged,
    run 3 started (run.json only), run 4 never started; the rerun trains runs 3 and 4 only."""
    from pipeline.config import load_config
    from pipeline.studies.runner import run_study
    from pipeline.studies.spec import StudyConfig

    cfg_path, out = finished_study
    c = _mlflow(out, monkeypatch)
    runs = sorted((out / "runs").glob("*/seed_*"))
    by_cell = {}
    for r in runs:
        by_cell.setdefault(r.parent.name, []).append(r)
    first, second = sorted(by_cell, key=lambda k: "lr-0.03-" in k)
    kept = by_cell[first]
    killed, never = by_cell[second]
    for r in (killed, never):
        c.delete_run(yaml.safe_load((r / "mlflow_run.json").read_text())["run_id"])
    shutil.rmtree(never)
    shutil.rmtree(killed / "train")
    (killed / "mlflow_run.json").unlink()
    for r in (killed, never):  # a run killed before it finished has no record
        (out.parent / "records" / r.parent.name / f"{r.name}.json").unlink()
    stamps = {r: (r / "train" / "summary.json").stat().st_mtime_ns for r in kept}

    summary = run_study(load_config(StudyConfig, cfg_path))
    assert summary["trained"] == [("lr=0.03", 0), ("lr=0.03", 1)]
    assert summary["skipped"] == [("lr=0.003", 0), ("lr=0.003", 1)]
    assert {r: (r / "train" / "summary.json").stat().st_mtime_ns for r in kept} == stamps
    assert len(pd.read_parquet(out / "results.parquet")) == 4
    exp = c.get_experiment_by_name("tiny")
    kids = [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert sorted((r.data.params["cell"], r.data.params["seed"]) for r in kids) == [
        ("lr=0.003", "0"), ("lr=0.003", "1"), ("lr=0.03", "0"), ("lr=0.03", "1")]
    # a third run finds everything finished
    again = run_study(load_config(StudyConfig, cfg_path))
    assert again["trained"] == [] and len(again["skipped"]) == 4


@pytest.mark.slow
@pytest.mark.e2e
def test_run_records_carry_a_study_to_another_sitting_and_generate_its_table(finished_study, tmp_path, capsys):
    """Another sitting (or machine): only the committed records are left, no run directory. The
    rerun skips every recorded run and reports the same numbers; a record of another config is
    trained again and replaced; the table generated from the records equals a recomputation."""
    from pipeline.config import load_config
    from pipeline.errors import PipelineError
    from pipeline.studies import tables
    from pipeline.studies.records import study_records
    from pipeline.studies.runner import run_study
    from pipeline.studies.spec import StudyConfig
    from pipeline.train.config import TrackingConfig

    cfg_path, out = finished_study
    records = tmp_path / "results" / "tiny"
    shutil.copytree(out.parent / "records", records)
    recs = study_records(records)
    assert len(recs) == 4 and {(r["cell"], r["seed"]) for r in recs} == {
        ("lr=0.003", 0), ("lr=0.003", 1), ("lr=0.03", 0), ("lr=0.03", 1)}
    for r in recs:
        assert len(r["config_hash"]) == 16 and r["wall_s"] > 0 and r["load_avg"]["after"] is not None
        assert r["launcher"] == "local" and r["curve"][-1]["split"] == "test"
    before = pd.read_parquet(out / "results.parquet").sort_values(["cell", "seed"]).reset_index(drop=True)

    spec = load_config(StudyConfig, cfg_path).model_copy(
        update={"output": str(tmp_path / "elsewhere"), "records": str(records), "tracking": TrackingConfig(enabled=False)})

    def rewrite(rec: dict, edit) -> Path:
        path = records / rec["cell_key"] / f"seed_{rec['seed']}.json"
        doc = json.loads(path.read_text())
        edit(doc["config"]["train"])
        doc["config_hash"] = "0" * 16
        path.write_text(json.dumps(doc))
        return path

    assert all(r["format"] == 2 and r["config"]["train"]["lr"] in (0.003, 0.03) for r in recs)
    changed = rewrite(recs[0], lambda t: t.update(lr=t["lr"] * 2))    # another value: trained again
    rewrite(recs[1], lambda t: t.pop("lr"))        # written without a key this run sets: trained again
    rewrite(recs[2], lambda t: t.pop("simulated_clock"))   # without a key this run leaves at its default: kept
    summary = run_study(spec)
    assert summary["trained"] == [(r["cell"], r["seed"]) for r in recs[:2]] and len(summary["skipped"]) == 2
    assert json.loads(changed.read_text())["config_hash"] == recs[0]["config_hash"]
    other = next(r for r in recs if r["cell_key"] != recs[0]["cell_key"])
    assert not (tmp_path / "elsewhere" / "runs" / other["cell_key"]).exists()   # never trained here
    after = pd.read_parquet(tmp_path / "elsewhere" / "results.parquet").sort_values(["cell", "seed"])
    after = after.reset_index(drop=True)
    for m in ("test_accuracy", "val_accuracy", "steps"):
        assert after[m].tolist() == pytest.approx(before[m].tolist()), m
    assert (tmp_path / "elsewhere" / "plots" / "learning_curves.png").is_file()  # curves from the records

    (records / "table.yaml").write_text(yaml.safe_dump({
        "metric": "test_accuracy", "source": "src", "row_header": "row",
        "rows": [{"label": "all", "where": {}}],
        "columns": [{"label": "lr 0.003", "where": {"train.lr": 0.003}, "source": ["1.00"]},
                    {"label": "lr 0.03", "where": {"train.lr": 0.03}}],
        "test": {"against": "lr 0.003", "alternative": "greater"}}))
    page = tmp_path / "results.md"
    page.write_text("intro\n<!-- results-table: tiny -->\nold\n<!-- /results-table -->\nend\n")
    cfg = tables.ResultsTablesConfig(page=str(page), results=str(tmp_path / "results"), check=True)
    with pytest.raises(PipelineError, match="out of date"):
        tables.results_tables(cfg)
    assert tables.results_tables(cfg.model_copy(update={"check": False}))["rewritten"]
    text = page.read_text()
    row = [ln for ln in text.splitlines() if ln.startswith("| all |")][0].split("|")[2:-1]
    for col, lr in ((1, 0.003), (2, 0.03)):
        acc = 100 * after.loc[after["train.lr"] == lr, "test_accuracy"]
        assert row[col].strip() == f"{acc.mean():.2f} ± {acc.std():.2f} (n = 2)"
    assert row[0].strip() == "1.00" and text.startswith("intro\n") and text.endswith("end\n")
    assert not tables.results_tables(cfg)["rewritten"]


def test_dry_run_counts_runs_and_distinct_layouts(tmp_path, capsys):
    doc = tiny_study(tmp_path, factors={"grid": {"shard.scheme": ["disjoint", "full_overlap"],
                                                 "train.lr": [0.003, 0.03]}},
                     baseline={"shard.scheme": "disjoint", "train.lr": 0.003}, seeds=3)
    doc["fixed"]["workers"] = 2
    cfg = write_yaml(tmp_path / "s.yaml", doc)
    assert experiment.main(["--config", str(cfg), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["runs"] == 12 and len(plan["cells"]) == 4 and plan["layouts"] == 2
    assert plan["baseline"] == "scheme=disjoint, lr=0.003"
    assert not (tmp_path / "tiny").exists()


@pytest.mark.slow
@pytest.mark.e2e
def test_runs_trained_two_at_once_equal_the_runs_trained_one_after_another(spark, tmp_path, tmp_path_factory, caplog):
    """``parallel_runs: 2``: the 4 runs train in two processes other than the driver, and every run's
    metrics, steps and record equal those of the same study run one run after another."""
    import logging

    from pipeline.config import load_config
    from pipeline.studies.records import study_records
    from pipeline.studies.runner import run_study
    from pipeline.studies.spec import StudyConfig

    data = str(tmp_path_factory.getbasetemp() / "studies_data")
    results = {}
    for n in (1, 2):
        doc = tiny_study(tmp_path, name=f"par{n}", data_dir=data, records=str(tmp_path / f"records{n}"),
                         parallel_runs=n, tracking={"enabled": False})
        doc["fixed"]["train.launcher"] = "inprocess"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pipeline.studies.runner"):
            summary = run_study(load_config(StudyConfig, write_yaml(tmp_path / f"par{n}.yaml", doc)), spark)
        assert len(summary["trained"]) == 4 and not summary["failed"]
        pids = {int(m.split("trained in process ")[1]) for m in caplog.messages if "trained in process" in m}
        assert (len(pids), os.getpid() in pids) == ((2, False) if n == 2 else (0, False)), pids
        df = pd.read_parquet(tmp_path / f"par{n}" / "results.parquet").sort_values(["cell", "seed"])
        recs = sorted(study_records(tmp_path / f"records{n}"), key=lambda r: (r["cell"], r["seed"]))
        results[n] = (df[["cell", "seed", "test_accuracy", "val_accuracy", "steps"]].to_dict("records"),
                      [(r["cell"], r["seed"], r["config_hash"], r["launcher"],
                        [r["metrics"][k] for k in ("test_accuracy", "test_loss", "val_accuracy", "bytes_sent")])
                       for r in recs])
    assert results[2] == results[1]
    assert len(results[1][1]) == 4


@pytest.mark.parametrize("change, needle", [
    ({"factors": {"grid": {"train.lr_typo": [0.1, 0.2]}}}, "train.lr_typo"),
    ({"factors": {"grid": {"train.lr": [0.1], "shard.schemes": ["disjoint"]}}}, "shard.schemes"),
    ({"factors": {"variants": [{"name": "x", "set": {"train.algorithm.params.nope": 1}}]}}, "nope"),
    ({"factors": {"grid": {"train.lr": []}}}, "factors.grid.train.lr is an empty list"),
    ({"factors": {}}, "empty factors"),
    ({"baseline": {"train.lr": 0.5}}, "baseline"),
    ({"factors": {"grid": {"train.lr": [-1.0]}}}, "train.lr"),
    ({"fixed": {"workers": 4, "shard.scheme": "households", "shard.households": 3}}, "households"),
    ({"metrics": ["accuracy_typo"]}, "accuracy_typo"),
    ({"target_accuracy": None, "metrics": ["time_to_target_s"]}, "needs target_accuracy"),
    ({"tracking": {"enabled": True, "uri": "nosuchscheme://x"}}, "tracking.uri='nosuchscheme://x'"),
    ({"parallel_runs": 2}, "parallel_runs=2 needs launcher inprocess; cell 'lr=0.003' trains with launcher 'local'"),
    ({"parallel_runs": 2, "output": "s3://b/tiny", "fixed": {"workers": 1, "ingest.source": "sklearn_digits",
      **{f"train.{k}": v for k, v in TINY_TRAIN.items()}, "train.launcher": "inprocess"}},
     "parallel_runs=2 needs a local output, not s3://b/tiny"),
])
def test_bad_study_gives_one_line_exit_2_and_starts_nothing(tmp_path, capsys, change, needle):
    doc = tiny_study(tmp_path)
    doc.update(change)
    cfg = write_yaml(tmp_path / "bad.yaml", doc)
    rc = experiment.main(["--config", str(cfg)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error:") and needle in err, err
    assert not (tmp_path / "tiny").exists()


@pytest.mark.filterwarnings("ignore:Precision loss")
def test_report_statistics_module_against_scipy():
    """The statistics on hand-made numbers (including a constant cell and a missing value)."""
    from pipeline.studies.stats import cell_stats

    df = pd.DataFrame({"cell": ["a"] * 3 + ["b"] * 3 + ["c"] * 2,
                       "m": [0.5, 0.6, 0.7, 0.9, 0.8, np.nan, 0.4, 0.4]})
    s = cell_stats(df, ["m"], "a").set_index("cell")
    assert s.loc["a", "mean"] == pytest.approx(0.6) and s.loc["a", "std"] == pytest.approx(0.1)
    lo, hi = sps.t.interval(0.95, 2, loc=0.6, scale=0.1 / math.sqrt(3))
    assert (s.loc["a", "ci_low"], s.loc["a", "ci_high"]) == pytest.approx((lo, hi))
    assert s.loc["b", "n"] == 2 and s.loc["b", "n_runs"] == 3
    assert s.loc["b", "p_value"] == pytest.approx(sps.ttest_ind([0.9, 0.8], [0.5, 0.6, 0.7], equal_var=False).pvalue)
    assert s.loc["c", "std"] == 0 and s.loc["c", "p_value"] == pytest.approx(
        sps.ttest_ind([0.4, 0.4], [0.5, 0.6, 0.7], equal_var=False).pvalue)
    assert math.isnan(s.loc["a", "p_value"])


@pytest.mark.slow
def test_plain_training_run_logs_to_mlflow(tmp_path, monkeypatch):
    """jobs/train.py with tracking.enabled=true: one MLflow run with the learning curve."""
    from train_fixtures import write_digit_shards

    from jobs import train as train_job

    man = write_digit_shards(tmp_path / "shards", workers=1, n_train=256, n_test=128, n_val=64)
    args = ["--manifest", str(man), "--launcher", "local", "--epochs", "1", "--eval_every", "4",
            "--batch_size", "32", "--progress", "false"]
    assert train_job.main(args + ["--output", str(tmp_path / "runs" / "t0")]) == 0
    assert not (tmp_path / "runs" / "mlruns").exists()  # off by default
    out = tmp_path / "runs" / "t1"
    rc = train_job.main(args + ["--output", str(out), "--set", "tracking.enabled=true",
                                "--set", "tracking.experiment=plain"])
    assert rc == 0
    # any tracking URI: here a file store elsewhere
    other = tmp_path / "elsewhere" / "store"
    assert train_job.main(args + ["--output", str(tmp_path / "runs" / "t2"), "--set", "tracking.enabled=true",
                                  "--set", f"tracking.uri=file://{other}"]) == 0
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    elsewhere = MlflowClient(tracking_uri=f"file://{other}")
    (r2,) = elsewhere.search_runs([elsewhere.get_experiment_by_name("train").experiment_id])
    assert r2.data.tags["pipeline.output"] == str(tmp_path / "runs" / "t2")
    c = _mlflow(tmp_path / "runs", monkeypatch)
    exp = c.get_experiment_by_name("plain")
    (run,) = c.search_runs([exp.experiment_id])
    curve = _curve(out / "metrics.jsonl")
    val = curve[curve["split"] == "val"]
    hist = sorted(c.get_metric_history(run.info.run_id, "val_accuracy"), key=lambda h: h.step)
    assert [(h.step, h.value) for h in hist] == list(zip(val["step"], val["accuracy"]))
    assert run.data.params["algorithm"] == "arsgd" and run.data.params["launcher"] == "local"
    test_acc = curve[curve["split"] == "test"]["accuracy"].iloc[-1]
    assert run.data.metrics["test_accuracy"] == pytest.approx(test_acc)
    assert {"metrics.jsonl", "summary.json", "learning_curve.png"} <= {a.path for a in c.list_artifacts(run.info.run_id)}
    written = sorted(p.name for p in (tmp_path / "runs").iterdir() if not p.name.endswith("-checkpoints"))
    assert written == ["mlruns", "t0", "t1", "t2"]  # the learning-curve PNG went to MLflow only



def test_shipped_studies_are_valid():
    """Every configs/experiments/*.yaml expands and validates (every cell and seed, layouts and
    algorithm parameters included) and has at least 3 seeds."""
    from pipeline.config import load_config
    from pipeline.studies.grid import plan_study
    from pipeline.studies.spec import StudyConfig

    configs = Path(__file__).resolve().parents[1] / "configs"
    files = sorted((configs / "experiments").glob("*.yaml"))
    names = {f.stem for f in files}
    assert {"overlap_full_vs_disjoint", "overlap_degrees", "local_sgd_periods", "households", "neighbourhoods",
            "hlf_algorithms", "speedup_vs_workers"} <= names
    for f in files + [configs / "experiment.yaml"]:
        spec = load_config(StudyConfig, f)
        plan = plan_study(spec)
        assert spec.name == f.stem or f.stem == "experiment"
        assert len(plan.seeds) >= 3 and len(plan.cells) >= 2, f
        algos = {plan.config(c, plan.seeds[0]).train.algorithm.name for c in plan.cells}
        assert algos, f


def test_speedup_groups_and_plot_when_workers_vary(tmp_path):
    """Workers as a grid factor: per setting, mean samples/s and time to target by M, and the PNG."""
    from pipeline.config import build_config
    from pipeline.report.study import plot_speedup
    from pipeline.studies.grid import plan_study
    from pipeline.studies.study_report import speedup_groups
    from pipeline.studies.spec import StudyConfig

    doc = tiny_study(tmp_path, factors={"grid": {"workers": [1, 2, 4]},
                                        "variants": [{"name": "a", "set": {}}, {"name": "b", "set": {"train.lr": 0.01}}]},
                     baseline={"variant": "a", "workers": 1})
    plan = plan_study(build_config(StudyConfig, doc))
    rows = []
    for c in plan.cells:
        for s in plan.seeds:
            m = c.factors["workers"]
            rows.append({"cell": c.name, "samples_per_s": 100.0 * m + s + (50 if c.factors["variant"] == "b" else 0),
                         "time_to_target_s": 10.0 / m})
    g = speedup_groups(plan, pd.DataFrame(rows))
    assert set(g) == {"variant=a", "variant=b"}
    assert g["variant=a"][4]["samples_per_s"] == pytest.approx(400.5) and g["variant=b"][1]["samples_per_s"] == 150.5
    assert g["variant=b"][2]["time_to_target_s"] == pytest.approx(5.0)
    png = plot_speedup(g, tmp_path / "s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.e2e
def test_a_failed_run_is_reported_and_the_others_are_kept(spark, tmp_path, tmp_path_factory, capsys):
    """A cell whose batch does not fit its shard fails at training time: the other cell's runs are
    trained and reported, the job exits 2 with one line naming the failed run."""
    doc = tiny_study(tmp_path, name="partial", seeds=1, data_dir=str(tmp_path_factory.getbasetemp() / "studies_data"),
                     factors={"grid": {"train.batch_size": [32, 100000]}}, baseline={"train.batch_size": 32},
                     metrics=["test_accuracy"], target_accuracy=None, tracking={"enabled": False})
    cfg = write_yaml(tmp_path / "p.yaml", doc)
    capsys.readouterr()
    assert experiment.main(["--config", str(cfg)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "1 of 2 runs failed" in err[0] and "batch_size=100000" in err[0], err
    out = tmp_path / "partial"
    df = pd.read_parquet(out / "results.parquet")
    assert list(df["train.batch_size"]) == [32] and df["test_accuracy"].between(0, 1).all()
    assert "batch_size=100000 seed 0" in (out / "report.md").read_text()
    (failed,) = [p for p in (out / "runs").glob("*/seed_0") if (p / "error.txt").exists()]
    assert "batch_size" in (failed / "error.txt").read_text() and not (failed / "train").exists()
    assert not (out / "mlruns").exists()


def test_hep_data_stages_chain_through_the_cache(tmp_path):
    """A HEP run's stages: each reads the keyed output of the one before, training reads the shard
    manifest and the scaling fitted by the feature stage; no real coffea samples."""
    from pipeline.config import load_config
    from pipeline.studies.grid import plan_study
    from pipeline.studies.runner import data_paths, stage_configs
    from pipeline.studies.spec import StudyConfig

    spec = load_config(StudyConfig, Path(__file__).resolve().parents[1] / "configs/experiments/speedup_vs_workers.yaml")
    plan = plan_study(spec)
    root = tmp_path / "data"
    layouts = set()
    for cell in plan.cells:
        p, todo = data_paths(plan.config(cell, 0), "hep", root)
        stages = {name: (cfg, out) for name, cfg, out in todo}
        assert list(stages) == ["simulate", "ingest", "features", "shard"]
        sim, ing, feat, sh = (stages[k][1] for k in ("simulate", "ingest", "features", "shard"))
        assert all(o.parent == root for o in (sim, ing, feat, sh))
        assert stages["ingest"][0].input == f"{sim}/*/*.root"
        assert stages["features"][0].input == str(ing)
        assert {s.files[0] for s in stages["features"][0].samples} == {f"{sim}/{n}/*.root" for n in ("qcd", "ttbar", "wjets")}
        assert stages["shard"][0].input == str(feat / "hlf") and stages["shard"][0].workers == cell.factors["workers"]
        p["train"] = tmp_path / "train"
        tr = stage_configs(plan.config(cell, 0), "hep", p)["train"]
        assert tr.manifest == str(sh / "manifest.json") and tr.scaling == str(feat / "scaling.json")
        layouts.add(sh)
        assert {"real_delphes", "real_features"}.isdisjoint(stage_configs(plan.config(cell, 0), "hep", p))
    assert len(layouts) == 4  # one per worker count; the events, ingestion and features are shared
    assert not root.exists()


def test_a_baseline_per_group_pairs_each_cell_with_its_own(tmp_path, capsys):
    """A baseline selection that matches several cells gives each cell the baseline that shares
    its other factor values (E3.2.4 compares S_H = 8 with S_H in {2, 1} at each L_W)."""
    from pipeline.config import build_config
    from pipeline.studies.grid import plan_study
    from pipeline.studies.spec import StudyConfig

    doc = tiny_study(tmp_path, factors={"grid": {"train.lr": [0.003, 0.03], "train.batch_size": [16, 32, 64]}},
                     baseline={"train.batch_size": 32})
    plan = plan_study(build_config(StudyConfig, doc))
    by_name = {c.name: plan.baselines[c.key].name for c in plan.cells}
    assert by_name["lr=0.003, batch_size=16"] == "lr=0.003, batch_size=32"
    assert by_name["lr=0.03, batch_size=64"] == "lr=0.03, batch_size=32"
    assert by_name["lr=0.03, batch_size=32"] == "lr=0.03, batch_size=32"
    cfg = write_yaml(tmp_path / "g.yaml", doc)
    assert experiment.main(["--config", str(cfg), "--dry-run"]) == 0
    dry = json.loads(capsys.readouterr().out)["plan"]
    assert dry["baseline"] == ["lr=0.003, batch_size=32", "lr=0.03, batch_size=32"]


@pytest.mark.filterwarnings("ignore:Precision loss")
def test_statistics_against_a_baseline_per_cell():
    from pipeline.studies.stats import cell_stats

    df = pd.DataFrame({"cell": ["a1"] * 3 + ["b1"] * 3 + ["a2"] * 3 + ["b2"] * 3,
                       "m": [0.5, 0.6, 0.7, 0.9, 0.8, 0.85, 0.1, 0.2, 0.25, 0.3, 0.35, 0.4]})
    s = cell_stats(df, ["m"], {"a1": "a1", "b1": "a1", "a2": "a2", "b2": "a2"}).set_index("cell")
    assert s.loc["b2", "p_value"] == pytest.approx(
        sps.ttest_ind([0.3, 0.35, 0.4], [0.1, 0.2, 0.25], equal_var=False).pvalue)
    assert s.loc["b1", "p_value"] == pytest.approx(
        sps.ttest_ind([0.9, 0.8, 0.85], [0.5, 0.6, 0.7], equal_var=False).pvalue)
    assert bool(s.loc["a2", "baseline"]) and math.isnan(s.loc["a2", "p_value"])
    assert s.loc["b2", "baseline_cell"] == "a2"


SHIPPED_STUDIES = sorted((Path(__file__).resolve().parents[1] / "configs" / "experiments").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("config", SHIPPED_STUDIES, ids=[p.stem for p in SHIPPED_STUDIES])
def test_each_shipped_study_runs_at_a_tiny_size(config, spark, tmp_path, tmp_path_factory):
    """Every configs/experiments/*.yaml end to end with ``tiny=true`` (one seed, two values per factor,
    4 steps on little data; pipeline/studies/tiny.py): every kept cell trains, with its own workers,
    layout, algorithm and schedule, and the report is written."""
    from pipeline.config import load_config
    from pipeline.ingest.images import FASHION_MNIST_DIR
    from pipeline.studies.grid import plan_study
    from pipeline.studies.spec import StudyConfig

    spec = load_config(StudyConfig, config)
    if "fashion_mnist" in config.read_text() or (spec.base and "haland" in spec.base):
        assert Path(FASHION_MNIST_DIR).is_dir(), "Fashion-MNIST is missing: run scripts/setup.sh (as root)"
    out = tmp_path / spec.name
    data = tmp_path_factory.getbasetemp() / "tiny_studies_data"  # shared: each dataset is made once
    args = ["--config", str(config), "--set", "tiny=true", "--set", f"output={out}", "--set", f"data_dir={data}",
            "--set", "tracking.enabled=false", "--set", "plots=false"]
    assert experiment.main(args) == 0
    plan = plan_study(spec.model_copy(update={"tiny": True}))
    df = pd.read_parquet(out / "results.parquet")
    assert len(df) == len(plan.runs) >= 2
    assert df["steps"].between(1, 8).all() and df["test_accuracy"].between(0, 1).all()  # rounds may end past step 4
    assert set(df["cell"]) == {c.name for c in plan.cells}
    for cell, seed in plan.runs:
        summary = json.loads((out / "runs" / cell.key / f"seed_{seed}" / "train" / "summary.json").read_text())
        cfg = plan.config(cell, seed)
        assert summary["workers"] == cfg.workers and summary["algorithm"] == cfg.train.algorithm.name
    assert "## " in (out / "report.md").read_text()


@pytest.mark.slow
def test_cifar10_resnet20_recipe_runs_on_the_cpu(spark, tmp_path):
    """configs/cifar10_resnet20.yaml (ResNet-20, He init, SGD + momentum, step decay, crop-and-flip) on a
    small batch file in the CIFAR-10 python format: the smoke run trains with the recipe's settings."""
    import pickle

    from jobs import run_images

    src = tmp_path / "cifar-10-batches-py"
    src.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 96), ("test_batch", 32)):
        labels = rng.integers(0, 10, n)
        data = (rng.random((n, 3072)) * 64 + labels[:, None] * 16).astype(np.uint8)  # learnable by class
        with open(src / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels.tolist(), b"data": data,
                         b"filenames": [f"{i}.png".encode() for i in range(n)]}, f, protocol=2)
    cfg = Path(__file__).resolve().parents[1] / "configs" / "cifar10_resnet20.yaml"
    out = tmp_path / "run"
    assert run_images.main(["--config", str(cfg), "--set", f"ingest.input={src}", "--set", f"output_root={out}",
                            "--set", "train.epochs=1", "--set", "train.max_steps=3", "--set", "train.batch_size=16"]) == 0
    summary = json.loads((out / "train" / "summary.json").read_text())
    run = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["algorithm"] == "arsgd" and 0 <= summary["test_accuracy"] <= 1
    assert run["model"] == "resnet20" and run["source"] == "cifar10" and run["rows"] == 128


@pytest.mark.parametrize("config", [p for p in SHIPPED_STUDIES if "run_images_haland" in p.read_text()],
                         ids=lambda p: p.stem)
def test_haland_studies_give_every_layout_the_disjoint_step_budget(config, tmp_path):
    """H&B run ceil(E_target / C) overlap epochs; unless C divides E_target an overlap layout gets up
    to 35% more steps than the disjoint one (the claim under test). Every cell's C divides E_target."""
    from pipeline.config import load_config
    from pipeline.studies.grid import plan_study
    from pipeline.studies.runner import data_paths
    from pipeline.studies.spec import StudyConfig

    plan = plan_study(load_config(StudyConfig, str(config)))
    copies = set()
    for cell in plan.cells:
        cfg = plan.config(cell, plan.seeds[0])
        shard_cfg = dict((n, c) for n, c, _ in data_paths(cfg, plan.spec.workflow, tmp_path)[1])["shard"]
        c = shard_cfg.layout().copies
        copies.add(c)
        assert cfg.train.epochs % c == 0, f"{cell.name}: E_target={cfg.train.epochs}, C={c}"
    assert copies  # the study has layouts to check


def test_results_page_is_generated_from_the_committed_records():
    """docs/results.md's tables are what `python -m jobs.results_tables` makes of results/ now: a
    record committed without regenerating the page, or a number edited by hand, fails here."""
    from pipeline.studies import tables

    assert not tables.results_tables(tables.ResultsTablesConfig(check=True))["rewritten"]
