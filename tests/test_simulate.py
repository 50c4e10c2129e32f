"""The simulation stage: real Pythia 8 + fastjet, real Spark tasks, real ROOT files read back with uproot.

One session fixture generates a small sample (a few hundred events per class) through the Spark
stage; the tests read those files. Runtime: about a minute of 2 cores for generation.
"""
from __future__ import annotations

import json

import awkward as ak
import numpy as np
import pytest
import uproot

from pipeline.commit import JobTarget
from pipeline.errors import ConfigError, PipelineError
from pipeline.simulate import SimulateConfig
from pipeline.simulate.delphes_io import SCHEMA, TREE, branch_names
from pipeline.simulate.stage import generate, make_tasks, plan_generate, run_task

N_PER_CLASS = 240
FILE_EVENTS = 120


def _cfg(out, **kw) -> SimulateConfig:
    base = dict(events=N_PER_CLASS, events_per_file=FILE_EVENTS, seed=2026, output=str(out), progress=False)
    base.update(kw)
    return SimulateConfig(**base)


@pytest.fixture(scope="session")
def simulated(spark, tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "simulated"
    cfg = _cfg(out)
    return cfg, generate(cfg, spark=spark)


def _read(files, branches):
    return ak.concatenate([uproot.open(f)[TREE].arrays(branches) for f in files])


def _arrays(simulated, process, branches):
    return _read(simulated[1]["files"][process], branches)


# ----------------------------------------------------------------------------------------- layout
@pytest.mark.slow
def test_files_and_sidecar(simulated):
    cfg, res = simulated
    side = json.loads(open(res["sidecar"]).read())
    assert side["format"] == "hep-pipeline-simulation/1" and side["seed"] == cfg.seed
    assert side["versions"]["pythia8mc"] == "8.317.2"
    for p in ("ttbar", "wjets", "qcd"):
        files = res["files"][p]
        assert len(files) == N_PER_CLASS // FILE_EVENTS
        assert sum(uproot.open(f)[TREE].num_entries for f in files) == N_PER_CLASS == res["events"][p]
        info = side["processes"][p]
        assert 0 < info["filter_efficiency"] < 1 and info["generated"] > N_PER_CLASS
        assert [f["pythia_seed"] for f in info["files"]] == [t["pythia_seed"] for t in make_tasks(cfg)
                                                             if t["process"] == p]
        assert any(s.startswith("Beams:eCM") for s in info["pythia_settings"])
    assert "HardQCD:hardbbbar = on" in side["processes"]["qcd"]["pythia_settings"]
    # event numbers are unique across files and classes
    nums = np.concatenate([ak.to_numpy(ak.flatten(_arrays(simulated, p, ["Event.Number"])["Event.Number"]))
                           for p in ("ttbar", "wjets", "qcd")])
    assert len(np.unique(nums)) == len(nums) == 3 * N_PER_CLASS


@pytest.mark.slow
def test_branches_mirror_real_delphes(simulated, delphes_root):
    """Every branch we write exists in a real Delphes 3 file under the same name and C type, and both
    files answer the same read calls."""
    real = uproot.open(delphes_root)["Delphes"]
    ours = uproot.open(simulated[1]["files"]["ttbar"][0])["Delphes"]
    for name in branch_names():
        assert name in ours, name
        assert name in real, f"{name} is not a real Delphes branch"
        assert ours[name].interpretation.content.to_dtype == real[name].interpretation.content.to_dtype, name
    for coll in SCHEMA:
        assert f"{coll}_size" in ours and f"{coll}_size" in real
    wanted = ["Electron.PT", "Electron.Eta", "Electron.Phi", "Electron.Charge", "Muon.PT", "Jet.PT", "Jet.BTag",
              "MissingET.MET", "MissingET.Phi", "EFlowTrack.PT", "EFlowTrack.X", "EFlowTrack.Y", "EFlowTrack.Z",
              "EFlowPhoton.ET", "EFlowNeutralHadron.ET"]
    a, b = real.arrays(wanted), ours.arrays(wanted)
    assert a.fields == b.fields == wanted
    assert str(a.type.content) == str(b.type.content)


# ------------------------------------------------------------------------------------ reproducibility
def _all_branches(path):
    return uproot.open(path)[TREE].arrays(branch_names())


@pytest.mark.slow
def test_same_seed_same_events_bit_for_bit(simulated, tmp_path):
    """Rerunning a task outside Spark with the same seed reproduces the Spark-written file exactly."""
    cfg, res = simulated
    task = [t for t in make_tasks(cfg) if t["process"] == "wjets"][1]
    target = JobTarget(str(tmp_path))
    r = run_task(task, cfg, target)
    assert "error" not in r and r["files"] == [task["file"]]
    a, b = _all_branches(res["files"]["wjets"][1]), _all_branches(target.file(r["attempt_dir"], task["file"]).path)
    for name in branch_names():
        x, y = a[name], b[name]
        assert ak.all(ak.num(x) == ak.num(y)), name
        assert np.array_equal(ak.to_numpy(ak.flatten(x)), ak.to_numpy(ak.flatten(y))), name


@pytest.mark.slow
def test_different_seed_different_events(simulated, tmp_path):
    cfg, res = simulated
    other = cfg.model_copy(update={"seed": cfg.seed + 1})
    task = [t for t in make_tasks(other) if t["process"] == "wjets"][1]
    target = JobTarget(str(tmp_path))
    r = run_task({**task, "events": 40}, other, target)
    assert "error" not in r
    a = _all_branches(res["files"]["wjets"][1])[:40]
    b = _all_branches(target.file(r["attempt_dir"], task["file"]).path)
    assert not np.array_equal(ak.to_numpy(ak.flatten(a["EFlowTrack.PT"])[:200]),
                              ak.to_numpy(ak.flatten(b["EFlowTrack.PT"])[:200]))
    assert not np.array_equal(ak.to_numpy(a["MissingET.MET"][:, 0]), ak.to_numpy(b["MissingET.MET"][:, 0]))


def test_task_seeds_are_distinct_and_stable():
    cfg = _cfg("/tmp/unused", events=1000, events_per_file=100)
    tasks = make_tasks(cfg)
    seeds = [t["pythia_seed"] for t in tasks]
    assert len(set(seeds)) == len(seeds) == 30
    assert all(1 <= s <= 900_000_000 for s in seeds)
    assert make_tasks(cfg) == tasks                      # pure function of the config
    assert make_tasks(cfg.model_copy(update={"seed": 1}))[0]["pythia_seed"] != tasks[0]["pythia_seed"]


# ------------------------------------------------------------------------------------ physics sanity
@pytest.mark.slow
def test_ttbar_has_more_jets_and_btags_than_wjets(simulated):
    tt = _arrays(simulated, "ttbar", ["Jet.PT", "Jet.BTag"])
    wj = _arrays(simulated, "wjets", ["Jet.PT", "Jet.BTag"])
    nj_tt, nj_wj = ak.mean(ak.num(tt["Jet.PT"])), ak.mean(ak.num(wj["Jet.PT"]))
    nb_tt, nb_wj = ak.mean(ak.sum(tt["Jet.BTag"], axis=1)), ak.mean(ak.sum(wj["Jet.BTag"], axis=1))
    assert nj_tt > nj_wj + 1.5, (nj_tt, nj_wj)
    assert nb_tt > 0.8 and nb_wj < 0.3, (nb_tt, nb_wj)


def _leading_lepton(arr):
    pt = ak.concatenate([arr["Electron.PT"], arr["Muon.PT"]], axis=1)
    phi = ak.concatenate([arr["Electron.Phi"], arr["Muon.Phi"]], axis=1)
    iso = ak.concatenate([arr["Electron.IsolationVar"], arr["Muon.IsolationVar"]], axis=1)
    i = ak.argmax(pt, axis=1, keepdims=True)
    return ak.flatten(pt[i]), ak.flatten(phi[i]), ak.flatten(iso[i])


LEP = ["Electron.PT", "Electron.Phi", "Electron.IsolationVar", "Muon.PT", "Muon.Phi", "Muon.IsolationVar",
       "MissingET.MET", "MissingET.Phi"]


@pytest.mark.slow
def test_wjets_transverse_mass_jacobian_peak(simulated):
    a = _arrays(simulated, "wjets", LEP)
    pt, phi, _ = _leading_lepton(a)
    ok = ~ak.is_none(pt)
    pt, phi = ak.to_numpy(pt[ok]), ak.to_numpy(phi[ok])
    met, mphi = ak.to_numpy(a["MissingET.MET"][ok][:, 0]), ak.to_numpy(a["MissingET.Phi"][ok][:, 0])
    mt = np.sqrt(2 * pt * met * (1 - np.cos(phi - mphi)))
    assert len(mt) > 0.75 * N_PER_CLASS
    hist, edges = np.histogram(mt, bins=np.arange(0, 150, 10))
    peak = edges[np.argmax(hist)]
    assert 55 <= peak <= 85, (peak, hist)
    below_edge = ((mt > 60) & (mt < 85)).sum()
    above_edge = ((mt > 95) & (mt < 120)).sum()
    assert below_edge > 3 * above_edge, (below_edge, above_edge)


@pytest.mark.slow
def test_qcd_lepton_isolation_worse_than_wjets(simulated):
    _, _, iso_q = _leading_lepton(_arrays(simulated, "qcd", LEP))
    _, _, iso_w = _leading_lepton(_arrays(simulated, "wjets", LEP))
    iso_q, iso_w = ak.to_numpy(ak.drop_none(iso_q)), ak.to_numpy(ak.drop_none(iso_w))
    assert np.median(iso_q) > 3 * np.median(iso_w), (np.median(iso_q), np.median(iso_w))
    assert (iso_q < 0.1).mean() < (iso_w < 0.1).mean() - 0.3


# -------------------------------------------------------------------------------- detector model units
def test_heavy_flavour_ancestry():
    from pipeline.simulate.detector import ancestry_flags

    # 0 proton, 1 b quark, 2 B0 (from the b string), 3 D*+ (from B0), 4 pi+ (from D*+), 5 K- (from 3),
    # 6 pi- (string, mother 1 = b quark), 7 D0 (prompt), 8 K+ (from D0), 9 upsilon-free gluon
    pdg = np.array([2212, 5, 511, 413, 211, -321, -211, 421, 321, 21])
    m1 = np.array([0, 0, 1, 2, 3, 3, 1, 0, 7, 0])
    b, c = ancestry_flags(pdg, m1)
    assert b.tolist() == [False, False, True, True, True, True, False, False, False, False]
    assert c.tolist() == [False, False, False, True, True, True, False, True, True, False]


# ------------------------------------------------------------------------------------ config / errors
def test_plan_and_dry_run(tmp_path, capsys):
    from jobs.simulate import main

    cfg = _cfg(tmp_path / "o", events=1200, events_per_file=500)
    plan = plan_generate(cfg)
    assert plan["tasks"] == 9 and len(plan["files"]["qcd"]) == 3
    assert main(["--dry-run", "--set", f"output={tmp_path / 'o'}", "--set", "events=10"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["tasks"] == 3
    assert not (tmp_path / "o").exists()


def test_default_config_file_matches_model_defaults(repo):
    from pipeline.config import load_config

    assert load_config(SimulateConfig, repo / "configs" / "simulate.yaml") == SimulateConfig()


@pytest.mark.parametrize("override, word", [("events=0", "events"), ("processes=[ttbar, zjets]", "processes"),
                                            ("detector.btag_efficiency=1.2", "btag_efficiency"),
                                            ("pythia={higgs: []}", "higgs")])
def test_bad_config_one_line(override, word, capsys):
    from jobs.simulate import main

    assert main(["--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and word in err[0]


@pytest.mark.slow
def test_failed_run_leaves_previous_output(simulated, spark, tmp_path):
    out = tmp_path / "sim"
    out.mkdir()
    (out / "keep.txt").write_text("previous run")
    (out / "_COMPLETE").write_text(json.dumps({"format": 2, "job": "0" * 12, "files": ["keep.txt"]}))  # ours
    cfg = _cfg(out, events=20, events_per_file=10, processes=["wjets"], pythia={"wjets": ["NoSuch:setting = 3"]})
    with pytest.raises(ConfigError, match="NoSuch:setting"):
        generate(cfg, spark=spark)
    assert (out / "keep.txt").read_text() == "previous run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sim"]


def test_filter_too_strict_is_reported(tmp_path):
    cfg = _cfg(tmp_path / "o", events=5, processes=["wjets"], max_attempts_factor=2, batch_size=10,
               lepton_filter={"pt_min": 5000.0})
    r = run_task(make_tasks(cfg)[0], cfg, JobTarget(str(tmp_path / "o")))
    assert "lepton filter" in r["error"] and "wjets" in r["error"]
    assert isinstance(PipelineError(r["error"]), PipelineError)


# ------------------------------------------------------------------------- the feature stage reads them
@pytest.mark.slow
def test_feature_function_same_code_path_on_generated_and_real(simulated, delphes_root):
    """The same read call and feature function on a real Delphes 3 file and on generated files."""
    from pipeline.features.delphes import REQUIRED_BRANCHES, compute_features
    from pipeline.features.layout import LLF_SIZE, N_HLF

    def run(path):
        return compute_features(uproot.open(path)[TREE].arrays(list(REQUIRED_BRANCHES)))

    real = run(delphes_root)
    assert real.n_read == 25 and len(real.index) >= 1
    assert real.hlf.shape == (len(real.index), N_HLF) and np.isfinite(real.hlf).all()
    frac = {}
    for p in ("ttbar", "wjets", "qcd"):
        fb = run(simulated[1]["files"][p][0])
        assert fb.hlf.shape[1] == N_HLF and fb.llf.shape[1] == LLF_SIZE and np.isfinite(fb.llf).all()
        frac[p] = len(fb.index) / fb.n_read
    assert frac["wjets"] > 0.7 and frac["ttbar"] > 0.5 and frac["qcd"] < frac["wjets"] - 0.3, frac


@pytest.mark.slow
def test_feature_stage_on_generated_and_real_files(simulated, delphes_root, spark, tmp_path):
    """One Spark feature-stage run over generated files of the three classes and the real delphes.root."""
    from pipeline.config import SparkConfig
    from pipeline.features.stage import FeaturesConfig, build_features

    out = simulated[1]["output"]
    cfg = FeaturesConfig(
        input=[f"{out}/*/*_0000.root", str(delphes_root)], output=str(tmp_path / "features"), step_size=150,
        samples=[{"name": "qcd", "label": 0, "files": ["*/qcd/*.root"]},
                 {"name": "ttbar", "label": 1, "files": ["*/ttbar/*.root", str(delphes_root)]},
                 {"name": "wjets", "label": 2, "files": ["*/wjets/*.root"]}],
        spark=SparkConfig(master="local[2]"))
    rep = build_features(cfg, spark=spark)
    assert not rep["bad_files"]
    by_file = {r["file"]: r for r in rep["files"]}
    assert by_file[str(delphes_root)]["events_read"] == 25 and by_file[str(delphes_root)]["written"] >= 1
    assert sum(r["events_read"] for r in rep["files"]) == 3 * FILE_EVENTS + 25
    hlf = spark.read.parquet(str(tmp_path / "features" / "hlf")).toPandas()
    assert sorted(hlf["label"].unique()) == [0, 1, 2]
    per_class = hlf.groupby("label").size()
    assert per_class[2] > 0.7 * FILE_EVENTS and per_class[0] < per_class[2]
