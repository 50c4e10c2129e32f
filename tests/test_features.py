"""Delphes selection, HLF and LLF against a direct reading of the real delphes.root, and the Spark
feature stage (ROOT and ingested-Parquet inputs, split, balancing, scaling, bad inputs)."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pyarrow.dataset as pads
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hep_root_fixtures as H  # noqa: E402

from pipeline.errors import BadInputError  # noqa: E402
from pipeline.features import delphes as D  # noqa: E402
from pipeline.features import layout as L  # noqa: E402

N, F = L.N_PARTICLES, L.N_LLF_FEATURES
IDX = {n: i for i, n in enumerate(L.LLF_NAMES)}


# ------------------------------------------------------------------ direct (per-event) reference
def _dphi(a, b):
    return (np.asarray(a, np.float64) - b + np.pi) % (2 * np.pi) - np.pi


def _ref_iso(pt, eta, phi, ev, exclude_self_track: bool):
    """Isolation sums of one particle, computed directly with numpy for one event."""
    out = []
    for coll, key, cut in (("EFlowTrack", "PT", 0.5), ("EFlowPhoton", "ET", 1.0), ("EFlowNeutralHadron", "ET", 1.0)):
        cpt = np.asarray(ev[f"{coll}.{key}"], np.float64)
        dr = np.hypot(np.asarray(ev[f"{coll}.Eta"], np.float64) - eta, _dphi(ev[f"{coll}.Phi"], phi))
        inside = (cpt > cut) & (dr < 0.3)
        if exclude_self_track and coll == "EFlowTrack":
            inside &= dr >= 1e-3
        out.append(cpt[inside].sum() / pt)
    return out


def _ref_select(arrs):
    """Per event: the chosen lepton (pt, eta, phi, charge, is_ele, isos) or None."""
    res = []
    for i in range(len(arrs)):
        ev = {k: arrs[k][i] for k in arrs.fields}
        leps = []
        for coll, is_ele in (("Electron", 1.0), ("Muon", 0.0)):
            for j in range(len(ev[f"{coll}.PT"])):
                pt = float(ev[f"{coll}.PT"][j])
                if pt <= 23.0:
                    continue
                eta, phi = float(ev[f"{coll}.Eta"][j]), float(ev[f"{coll}.Phi"][j])
                iso = _ref_iso(pt, eta, phi, ev, True)
                if sum(iso) < 0.45:
                    leps.append((pt, eta, phi, float(ev[f"{coll}.Charge"][j]), is_ele, *iso))
        res.append(max(leps, key=lambda x: x[0]) if leps else None)
    return res


@pytest.fixture(scope="module")
def real_events(delphes_root):
    import uproot
    return uproot.open(delphes_root)["Delphes"].arrays(list(D.REQUIRED_BRANCHES))


@pytest.fixture(scope="module")
def boosted_file(delphes_root, tmp_path_factory):
    """delphes.root's events with an added 40 GeV muon along the leading track (more selected events)."""
    p = tmp_path_factory.mktemp("boosted") / "boosted.root"
    return H.write_delphes_like(p, H.boosted(H.read_required(delphes_root)))


@pytest.fixture(scope="module")
def boosted_events(boosted_file):
    import uproot
    return uproot.open(boosted_file)["Delphes"].arrays(list(D.REQUIRED_BRANCHES))


def test_required_branches_exist_in_real_delphes(delphes_root):
    import uproot
    names = set(uproot.open(delphes_root)["Delphes"].keys(recursive=True, full_paths=False))
    assert set(D.REQUIRED_BRANCHES) <= names
    assert L.LLF_SIZE == 15219 and L.N_HLF == 14


@pytest.mark.parametrize("which", ["real_events", "boosted_events"])
def test_selection_matches_direct_isolation_count(which, request):
    arrs = request.getfixturevalue(which)
    ref = _ref_select(arrs)
    sel = D.select_events(arrs)
    assert sel.index.tolist() == [i for i, r in enumerate(ref) if r is not None]
    if which == "real_events":
        assert sel.index.tolist() == [14]           # the one event of the sample with an isolated lepton
    else:
        assert len(sel.index) >= 5
    for k, i in enumerate(sel.index):
        r = ref[i]
        np.testing.assert_allclose(sel.lepton[k], np.asarray(r), rtol=1e-5, atol=1e-6)   # LEPTON_FIELDS order


@pytest.mark.parametrize("which", ["real_events", "boosted_events"])
def test_hlf_agree_with_direct_reading(which, request):
    arrs = request.getfixturevalue(which)
    block = D.compute_features(arrs)
    ref = _ref_select(arrs)
    assert block.hlf.shape == (len(block.index), 14) and block.n_read == 25
    h = {n: block.hlf[:, i] for i, n in enumerate(L.HLF_NAMES)}
    for k, i in enumerate(block.index):
        jpt, jeta = np.asarray(arrs["Jet.PT"][i]), np.asarray(arrs["Jet.Eta"][i])
        good = (jpt > 30) & (np.abs(jeta) < 2.6)
        met, phimet = float(arrs["MissingET.MET"][i][0]), float(arrs["MissingET.Phi"][i][0])
        lep = ref[i]
        assert h["HT"][k] == pytest.approx(jpt[good].sum(), rel=1e-5)
        assert h["nJets"][k] == good.sum()
        assert h["nBjets"][k] == (good & (np.asarray(arrs["Jet.BTag"][i]) > 0)).sum()
        assert h["MET"][k] == pytest.approx(met, rel=1e-6) and h["phiMET"][k] == pytest.approx(phimet, rel=1e-6)
        assert h["LepPt"][k] == pytest.approx(lep[0], rel=1e-6)
        mt = math.sqrt(2 * lep[0] * met * (1 - math.cos(lep[2] - phimet)))   # the true transverse mass
        assert h["MT"][k] == pytest.approx(mt, rel=1e-4)
        assert h["LepIsEle"][k] == lep[4] and h["LepCharge"][k] == lep[3]


def _check_llf(llf, npart, lep_pt, arrs, i, caps=(450, 150, 200)):
    """Length, lepton row, ordering, padding, group contents and caps of one event's LLF."""
    m = llf.reshape(N, F)
    n = int(npart)
    assert m[0, IDX["Pt"]] == pytest.approx(lep_pt, rel=1e-6)
    assert m[0, IDX["isEle"]] + m[0, IDX["isMu"]] == 1
    assert not m[n:].any()                                        # zero padding after the real particles
    lep_eta, lep_phi = m[0, IDX["Eta"]], m[0, IDX["Phi"]]
    dr = np.hypot(m[1:n, IDX["Eta"]] - lep_eta, _dphi(m[1:n, IDX["Phi"]], lep_phi))
    assert np.all(np.diff(dr) <= 1e-5)                            # decreasing dR from the lepton
    trk = (m[1:n, IDX["isChHad"]] + m[1:n, IDX["isEle"]] + m[1:n, IDX["isMu"]]) == 1
    pho, neu = m[1:n, IDX["isGamma"]] == 1, m[1:n, IDX["isNeuHad"]] == 1
    assert trk.sum() + pho.sum() + neu.sum() == n - 1
    # group sizes: the candidates above threshold (the lepton's own track removed), capped
    tpt = np.asarray(arrs["EFlowTrack.PT"][i])
    tdr = np.hypot(np.asarray(arrs["EFlowTrack.Eta"][i]) - lep_eta, _dphi(arrs["EFlowTrack.Phi"][i], lep_phi))
    n_trk = int(((tpt > 0.5) & (tdr >= 1e-3)).sum())
    n_pho = int((np.asarray(arrs["EFlowPhoton.ET"][i]) > 1).sum())
    n_neu = int((np.asarray(arrs["EFlowNeutralHadron.ET"][i]) > 1).sum())
    assert (trk.sum(), pho.sum(), neu.sum()) == (min(n_trk, caps[0]), min(n_pho, caps[1]), min(n_neu, caps[2]))
    # when a cap bites, the highest-pT (ET) ones are kept
    bit = False
    for mask, coll, key, cap, n_all in ((pho, "EFlowPhoton", "ET", caps[1], n_pho),
                                        (neu, "EFlowNeutralHadron", "ET", caps[2], n_neu)):
        if n_all > cap:
            et = np.sort(np.asarray(arrs[f"{coll}.{key}"][i]))[::-1]
            assert m[1:n][mask, IDX["Pt"]].min() == pytest.approx(et[cap - 1], rel=1e-6)
            bit = True
    return bit


def test_llf_layout_on_selected_events(boosted_events):
    block = D.compute_features(boosted_events)
    assert block.llf.shape == (len(block.index), 15219) and block.llf.dtype == np.float32
    for k, i in enumerate(block.index):
        _check_llf(block.llf[k], block.n_particles[k], block.hlf[k, 6], boosted_events, i)


@pytest.mark.parametrize("caps", [(450, 150, 200), (40, 30, 20)])
def test_llf_caps_and_isolation_before_selection(real_events, caps, monkeypatch):
    """Every event of delphes.root, with its leading track taken as a pseudo-lepton: group sizes,
    ordering and padding, the caps (the sample never reaches 150 photons, so smaller caps are
    patched in too, to see them bite) and each particle's isolation."""
    monkeypatch.setitem(L.CAPS, "tracks", caps[0])
    monkeypatch.setitem(L.CAPS, "photons", caps[1])
    monkeypatch.setitem(L.CAPS, "neutrals", caps[2])
    cols = D.columns(real_events)
    trk = cols.tracks
    lead = np.array([trk.off[e] + np.argmax(trk["pt"][trk.off[e]:trk.off[e + 1]]) for e in range(cols.n)])
    lep = np.zeros((cols.n, 8))
    lep[:, 0], lep[:, 1], lep[:, 2], lep[:, 3] = (trk[c][lead] for c in ("pt", "eta", "phi", "charge"))
    llf, npart = D.low_level(cols, np.arange(cols.n), lep)
    capped = [_check_llf(llf[i], npart[i], lep[i, 0], real_events, i, caps) for i in range(cols.n)]
    assert any(capped) == (caps[1] < 150)   # the small caps were exercised
    # isolation of a few particles of event 3 against the direct sums (the particle itself excluded)
    ev = {k: real_events[k][3] for k in real_events.fields}
    m = llf[3].reshape(N, F)
    for row in (1, 5, int(npart[3]) - 1):
        pt, eta, phi = (float(m[row, IDX[c]]) for c in ("Pt", "Eta", "Phi"))
        ref = np.asarray(_ref_iso(pt, eta, phi, ev, False))
        own = 0 if m[row, IDX["isChHad"]] + m[row, IDX["isEle"]] + m[row, IDX["isMu"]] == 1 else \
            (1 if m[row, IDX["isGamma"]] == 1 else 2)
        ref[own] -= 1.0                     # its own pT/pT
        got = m[row, [IDX["ChPFIso"], IDX["GammaPFIso"], IDX["NeuPFIso"]]]
        np.testing.assert_allclose(got, np.maximum(ref, 0), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ the Spark stage
@pytest.fixture(scope="module")
def three_samples(delphes_root, tmp_path_factory):
    """qcd/ttbar/wjets Delphes-layout files (boosted delphes.root events, different subsets)."""
    base = tmp_path_factory.mktemp("sim")
    colls = H.boosted(H.read_required(delphes_root))
    subsets = {"qcd": list(range(0, 14)), "ttbar": list(range(25)), "wjets": list(range(24, -1, -1))}
    for name, idx in subsets.items():
        (base / name).mkdir()
        H.write_delphes_like(base / name / f"{name}_0000.root", H.take(colls, idx))
    return base


def _samples(base):
    return [{"name": "qcd", "label": "qcd", "files": [f"{base}/qcd/*.root"]},
            {"name": "ttbar", "label": 1, "files": [f"{base}/ttbar/*.root"]},
            {"name": "wjets", "label": 2, "files": [f"{base}/wjets/*.root"]}]


def _table(path):
    return pads.dataset(str(path), format="parquet", ignore_prefixes=[".", "_"]).to_table().to_pandas()


@pytest.mark.slow
def test_feature_stage_root_and_ingested_inputs_agree(spark, three_samples, tmp_path):
    from pipeline.features.stage import FeaturesConfig, build_features
    from pipeline.ingest.root import IngestRootConfig, ingest_root
    from pipeline.schemas import load_schema, validate_parquet
    import pyarrow.parquet as pq

    cfg = FeaturesConfig(samples=_samples(three_samples), output=str(tmp_path / "f_root"), step_size=10,
                         test_fraction=0.2, val_fraction=0.15, seed=7, llf_row_group_mb=0.25)
    rep = build_features(cfg, spark=spark)
    files = {os.path.basename(f["file"]): f for f in rep["files"]}
    assert [files[n]["events_read"] for n in ("qcd_0000.root", "ttbar_0000.root", "wjets_0000.root")] == [14, 25, 25]
    sel = {n: files[n]["selected"] for n in files}
    assert sel["ttbar_0000.root"] == sel["wjets_0000.root"] >= 5 and sel["qcd_0000.root"] >= 2
    assert all(f["written"] == f["selected"] for f in rep["files"])
    hlf = _table(rep["hlf"])
    llf = _table(rep["llf"])
    total = sum(sel.values())
    assert sorted(hlf.sample_id) == list(range(total)) == sorted(llf.sample_id)   # dense, stable ids
    # exact stratified split sizes
    for lab, n in zip((0, 1, 2), (sel["qcd_0000.root"], sel["ttbar_0000.root"], sel["wjets_0000.root"])):
        c = hlf[hlf.label == lab].split.value_counts().to_dict()
        assert c.get("test", 0) == math.floor(n * 0.2) and c.get("val", 0) == math.floor(n * 0.15)
    validate_parquet(rep["hlf"], load_schema("hlf", 2))
    validate_parquet(rep["llf"], load_schema("llf", 3))
    assert [len(x) for x in llf.llf] == [19 * n for n in llf.n_particles] and all(len(x) == 14 for x in hlf.hlf)
    parts = [os.path.join(rep["llf"], p) for p in os.listdir(rep["llf"]) if p.endswith(".parquet")]
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in parts) == total
    # scaling fitted on train only; LLF statistics over real particles only
    sc = json.loads((tmp_path / "f_root" / "scaling.json").read_text())
    train = hlf[hlf.split == "train"]
    x = np.stack(train.hlf.to_numpy()).astype(np.float64)
    np.testing.assert_allclose(sc["hlf"]["mean"], x.mean(axis=0), rtol=1e-6, atol=1e-6)
    std = x.std(axis=0)
    np.testing.assert_allclose(sc["hlf"]["std"], np.where(std > 0, std, 1.0), rtol=1e-6, atol=1e-6)
    tl = llf[llf.split == "train"]
    real = np.concatenate([np.asarray(v, np.float64).reshape(-1, F) for v in tl.llf])
    np.testing.assert_allclose(sc["llf"]["mean"], real.mean(axis=0), rtol=1e-6, atol=1e-6)
    assert sc["llf"]["count"] == len(real) == tl.n_particles.sum() and len(sc["llf"]["std"]) == 19
    from pipeline.features.scaling import FeatureScaler, ScalingModel
    from pipeline.outputs import uri
    # the Spark estimator on the written train rows (real particles only) agrees with the stage's fit
    fitted = FeatureScaler().fit(spark.read.parquet(uri(rep["llf"])).where("split = 'train'"))
    np.testing.assert_allclose(fitted.llf_mean, sc["llf"]["mean"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fitted.llf_std, sc["llf"]["std"], rtol=1e-6, atol=1e-6)
    assert fitted.llf_count == sc["llf"]["count"]
    model = ScalingModel.load(tmp_path / "f_root" / "scaling.json")
    padded = np.zeros((len(tl), N * F), np.float32)
    for i, v in enumerate(tl.llf):
        padded[i, :len(v)] = v
    scaled = model.transform_llf(padded, tl.n_particles.to_numpy()).reshape(-1, N, F)
    assert not scaled[0, int(tl.n_particles.iloc[0]):].any()          # padding stays zero
    # the file is the ScalingFile contract: a wrong length or a zero std is refused, naming the file
    bad = dict(sc, llf={**sc["llf"], "std": sc["llf"]["std"][:18]})
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(BadInputError, match=r"bad\.json: not a valid scaling\.json \(llf\.std"):
        ScalingModel.load(tmp_path / "bad.json")
    (tmp_path / "zero.json").write_text(json.dumps(dict(sc, hlf={**sc["hlf"], "std": [0.0] * 14})))
    with pytest.raises(BadInputError, match=r"zero\.json: .*hlf\.std\.0"):
        ScalingModel.load(tmp_path / "zero.json")

    # the same files ingested first, then the stage on the Parquet: identical datasets
    ev = tmp_path / "events"
    ingest_root(IngestRootConfig(input=f"{three_samples}/*/*.root", tree="Delphes", output=str(ev),
                                 filter_name=list(D.REQUIRED_BRANCHES), schema_dir=str(tmp_path / "schemas")),
                spark=spark)
    cfg2 = cfg.model_copy(update={"input": str(ev), "output": str(tmp_path / "f_pq")})
    rep2 = build_features(cfg2, spark=spark)
    hlf2 = _table(rep2["hlf"])
    a = hlf.sort_values("sample_id").reset_index(drop=True)
    b = hlf2.sort_values("sample_id").reset_index(drop=True)
    assert a.split.tolist() == b.split.tolist() and a.label.tolist() == b.label.tolist()
    np.testing.assert_array_equal(np.stack(a.hlf.to_numpy()), np.stack(b.hlf.to_numpy()))


def test_parquet_row_groups_follow_the_setting(spark, three_samples, tmp_path):
    """The writers of hlf/ and llf/ cut row groups at the requested size (readers hold one row
    group at a time): 0.0005 MiB of HLF rows is 6 rows; LLF rows vary with their particles, so
    every LLF row group holds as many rows as fit in 0.05 MiB of values (at least one), across
    the chunks' boundaries."""
    import pyarrow.parquet as pq
    from pipeline.features.rows import llf_row_bytes
    from pipeline.features.stage import FeaturesConfig, build_features

    budget = int(0.05 * (1 << 20))
    cfg = FeaturesConfig(samples=_samples(three_samples), output=str(tmp_path / "f"), llf_row_group_mb=0.05,
                         hlf_row_group_mb=0.0005, step_size=4)   # chunks of 4 entries: row groups span chunks
    rep = build_features(cfg, spark=spark)
    total = 0
    for p in sorted(p for p in os.listdir(rep["hlf"]) if p.endswith(".parquet")):
        meta = pq.ParquetFile(os.path.join(rep["hlf"], p)).metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        assert all(n == 6 for n in sizes[:-1]) and 0 < sizes[-1] <= 6, (p, sizes)
        total += sum(sizes)
    assert total == sum(rep["splits"].values()) > 12
    groups = 0
    for p in sorted(p for p in os.listdir(rep["llf"]) if p.endswith(".parquet")):
        f = pq.ParquetFile(os.path.join(rep["llf"], p))
        row_bytes = [llf_row_bytes(f.read_row_group(i, columns=["n_particles"]).column(0).to_numpy())
                     for i in range(f.metadata.num_row_groups)]
        for i, b in enumerate(row_bytes):
            assert len(b) == 1 or b.sum() <= budget, (p, i, b)                       # never over the budget
            if i + 1 < len(row_bytes):
                assert b.sum() + row_bytes[i + 1][0] > budget, (p, i)               # full: the next row did not fit
        groups += len(row_bytes)
    assert groups >= 4
    assert not os.path.exists(tmp_path / "f" / "_work")


@pytest.mark.slow
@pytest.mark.parametrize("step_size, work_compression", [(4, "none"), (25, "lz4")])
def test_feature_stage_rows_are_each_events_features_in_sample_id_order(spark, three_samples, tmp_path,
                                                                         monkeypatch, step_size, work_compression):
    """Every written row is its event's features: the files read whole with uproot and
    compute_features, numbered in (file, entry) order, split and balanced by ``assign``, must be
    the rows of llf/ and hlf/ (chunks of 4 entries packed several per task, or whole files; work
    files in batches of 2 rows, uncompressed or LZ4; balancing dropping rows inside chunks and
    batches; LLF spread over several files)."""
    import uproot

    from pipeline.features import workfiles
    from pipeline.features.split import SPLITS, assign
    from pipeline.features.stage import FeaturesConfig, build_features

    monkeypatch.setattr(workfiles, "IPC_BATCH_ROWS", 2)
    cfg = FeaturesConfig(samples=_samples(three_samples), output=str(tmp_path / "f"), step_size=step_size, file_mb=1,
                         test_fraction=0.3, val_fraction=0.2, seed=5, balance_classes=True,
                         work_compression=work_compression)
    rep = build_features(cfg, spark=spark)
    blocks, labels = [], []
    for f in rep["files"]:
        b = D.compute_features(uproot.open(f["file"])["Delphes"].arrays(list(D.REQUIRED_BRANCHES)))
        blocks.append(b)
        labels += [f["label"]] * len(b.index)
    asg = assign(np.array(labels, np.int64), [0, 1, 2], 5, 0.3, 0.2, True)
    keep = np.flatnonzero(asg.keep)
    assert 0 < len(keep) < len(labels)                     # balancing dropped some events
    llf, hlf = _table(rep["llf"]).sort_values("sample_id"), _table(rep["hlf"]).sort_values("sample_id")
    assert len(os.listdir(rep["llf"])) >= 2
    for t in (llf, hlf):
        assert t.sample_id.tolist() == keep.tolist()
        assert t.label.tolist() == np.array(labels)[keep].tolist()
        assert t.split.tolist() == [SPLITS[i] for i in asg.split[keep]]
        np.testing.assert_array_equal(np.stack(t.hlf.to_numpy()), np.concatenate([b.hlf for b in blocks])[keep])
    want, n_want = np.concatenate([b.llf for b in blocks])[keep], np.concatenate([b.n_particles for b in blocks])[keep]
    assert llf.n_particles.tolist() == n_want.tolist()
    for row, w, n in zip(llf.llf, want, n_want):     # the real particles, in order; nothing else
        np.testing.assert_array_equal(row, w[:19 * n])
        assert not w[19 * n:].any()


@pytest.mark.parametrize("sizes,budget,final,want", [
    ([3, 3, 3, 3], 7, True, [2, 4]),          # two rows fit in 7, a third does not
    ([3, 3, 3, 3], 7, False, [2]),            # the last two rows could still take a row: they wait
    ([3, 3, 3, 3], 6, False, [2, 4]),         # a full group is written at once
    ([10, 1, 1], 5, True, [1, 3]),            # a row over the budget is a group of its own
    ([10, 1, 1], 5, False, [1]),
    ([], 5, True, []),
])
def test_llf_row_groups_hold_as_many_rows_as_fit(sizes, budget, final, want):
    from pipeline.features.writers import row_group_cuts

    assert row_group_cuts(np.array(sizes, np.int64), budget, final) == want


@pytest.mark.parametrize("entries,slots,want", [
    ([2000] * 8, 2, [0, 0, 0, 0, 1, 1, 1, 1]),             # 16,000 entries: one task per slot
    ([2000] * 8, 8, list(range(8))),                        # as many slots as chunks: one chunk each
    ([50_000] * 5, 2, [0, 1, 2, 3, 4]),                     # big chunks: one each
    ([2000] * 12, 2, [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3),  # 24,000 entries: 3 tasks -> 4, a multiple of the slots
    ([2000] * 7, 4, [0, 0, 1, 1, 2, 2, 3]),                 # 14,000 entries, 4 slots: 4 tasks, not 2
    ([4000] * 10, 2, [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]),       # 40,000 entries: 4 tasks, cut at 10k, 20k, 30k
    ([10, 10, 10, 5000, 10], 2, [0, 0, 0, 0, 1]),           # consecutive: a task ends after its share
    ([], 2, []),
])
def test_feature_chunks_are_packed_into_tasks(entries, slots, want):
    from pipeline.features.plan import pack_units

    assert pack_units(entries, slots, task_entries=10_000) == want


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_work_files_hold_the_selected_events_under_each_compression(tmp_path, compression):
    """A work file holds each event's real particles, n_particles and hlf, in event order and in
    batches; LZ4 and zstd files are compressed (the zero-heavy block takes far fewer bytes)."""
    from types import SimpleNamespace

    import pyarrow as pa

    from pipeline.features.workfiles import read_batches, save_block
    from pipeline.fs import location

    rng = np.random.default_rng(3)
    n_part = np.array([1, 5, 801, 2, 40], np.int32)
    llf = np.zeros((len(n_part), L.N_PARTICLES, L.N_LLF_FEATURES), np.float32)
    for i, k in enumerate(n_part):
        llf[i, :k] = np.round(rng.normal(size=(k, L.N_LLF_FEATURES)), 1)
    hlf = rng.normal(size=(len(n_part), L.N_HLF)).astype(np.float32)
    block = SimpleNamespace(llf=llf.reshape(len(n_part), -1), n_particles=n_part, hlf=hlf)
    sizes = {}
    for c in ("none", compression):
        path = tmp_path / f"{c}.arrow"
        with pa.OSFile(str(path), "wb") as sink:
            save_block(block, sink, batch_rows=2, compression=c)
        sizes[c] = path.stat().st_size
        batches = list(read_batches(location(str(path))))
        assert len(batches) == 3
        t = pa.Table.from_batches(batches)
        assert t.column("n_particles").to_pylist() == n_part.tolist()
        assert np.array_equal(np.stack(t.column("hlf").to_pylist()).astype(np.float32), hlf)
        for i, k in enumerate(n_part):
            assert np.array_equal(np.asarray(t.column("llf")[i].as_py(), np.float32), llf[i, :k].reshape(-1))
    if compression != "none":
        assert sizes[compression] < 0.8 * sizes["none"], sizes


def test_feature_stage_refuses_an_unknown_work_compression(three_samples, tmp_path):
    from pydantic import ValidationError

    from pipeline.features.stage import FeaturesConfig

    with pytest.raises(ValidationError, match="work_compression"):
        FeaturesConfig(samples=_samples(three_samples), output=str(tmp_path / "f"), work_compression="snappy")


def test_feature_stage_balancing_is_seeded(any_spark, three_samples, tmp_path):
    spark = any_spark   # a classic and a Spark Connect session: the stage's tasks, thresholds and writers
    from pipeline.features.stage import FeaturesConfig, build_features

    cfg = FeaturesConfig(samples=_samples(three_samples), output=str(tmp_path / "b1"), test_fraction=0.3,
                         val_fraction=0.0, balance_classes=True, seed=3)
    rep = build_features(cfg, spark=spark)
    hlf = _table(rep["hlf"])
    for split in ("train", "test"):
        counts = hlf[hlf.split == split].label.value_counts()
        assert len(counts) == 3 and counts.nunique() == 1               # balanced in every split
    assert rep["classes"]["0"]["train"] == rep["classes"]["1"]["train"] == (hlf.split == "train").sum() / 3


def test_feature_stage_bad_inputs(spark, delphes_root, bad_delphes_root, tmp_path):
    from pipeline.features.stage import FeaturesConfig, build_features

    empty = H.write_delphes_like(tmp_path / "empty.root", H.read_required(delphes_root), empty=True)
    no_cands = H.write_delphes_like(tmp_path / "no_candidates.root",
                                    {k: v[:, :0] for k, v in H.read_required(delphes_root).items()})
    plain = H.write_plain_tree(tmp_path / "plain.root")
    cfg = FeaturesConfig(input=[str(delphes_root), str(bad_delphes_root), str(plain), str(empty), str(no_cands)],
                         samples=[{"name": "ttbar", "label": 1, "files": ["*.root"]}],
                         output=str(tmp_path / "out"))
    with pytest.raises(BadInputError) as ei:
        build_features(cfg, spark=spark)
    assert "\n" not in str(ei.value) and "2 of 5 input file(s) failed" in str(ei.value)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    reasons = {os.path.basename(b["file"]): b["reason"] for b in rep["bad_files"]}
    assert "no tree 'Delphes'" in reasons["bad_delphes.root"]
    assert "missing branch 'Electron.PT'" in reasons["plain.root"]
    files = {os.path.basename(f["file"]): f for f in rep["files"]}
    assert files["empty.root"]["events_read"] == 0 and files["empty.root"]["error"] is None
    nc = files["no_candidates.root"]          # events whose collections are all empty: no rows, no error
    assert (nc["events_read"], nc["selected"], nc["written"], nc["error"]) == (25, 0, 0, None)
    assert (files["delphes.root"]["events_read"], files["delphes.root"]["selected"]) == (25, 1)
    assert len(_table(tmp_path / "out" / "hlf")) == 1


def test_feature_stage_with_nothing_selected_writes_empty_datasets(spark, delphes_root, tmp_path):
    """Only events without candidates: no rows and no error; hlf/ and llf/ still carry their
    columns (an empty file each), so readers and the schema check see the datasets."""
    from pipeline.features.stage import FeaturesConfig, build_features

    nc = H.write_delphes_like(tmp_path / "no_candidates.root",
                              {k: v[:, :0] for k, v in H.read_required(delphes_root).items()})
    rep = build_features(FeaturesConfig(input=[str(nc)], samples=[{"name": "t", "label": 1, "files": ["*.root"]}],
                                        output=str(tmp_path / "out")), spark=spark)
    assert rep["splits"] == {"train": 0, "val": 0, "test": 0} and not rep["bad_files"]
    for name in ("hlf", "llf"):
        t = pads.dataset(rep[name], format="parquet").to_table()
        assert t.num_rows == 0 and {"sample_id", "label", "split", "hlf"} <= set(t.column_names)
    assert "llf" in pads.dataset(rep["llf"], format="parquet").schema.names


def test_features_job_dry_run_and_config_errors(repo, capsys):
    from jobs.features import main

    assert main(["--config", str(repo / "configs" / "features.yaml"), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["required_branches"] == list(D.REQUIRED_BRANCHES)
    assert main(["--config", str(repo / "configs" / "features.yaml"), "--set", "test_fraction=0.9",
                 "--set", "val_fraction=0.2", "--dry-run"]) == 2
    assert "test_fraction + val_fraction" in capsys.readouterr().err


# ------------------------------------------------------------------ the fast path against a per-event reference
CONE2 = D.ISO_CONE * D.ISO_CONE
EXCL2 = D.SELF_MATCH_DR * D.SELF_MATCH_DR
KIN = {"EFlowTrack": "PT", "EFlowPhoton": "ET", "EFlowNeutralHadron": "ET"}
CUT = {"EFlowTrack": D.TRACK_PT_MIN, "EFlowPhoton": D.PHOTON_ET_MIN, "EFlowNeutralHadron": D.NEUTRAL_ET_MIN}


def _d2(eta, phi, eta0, phi0):
    de = np.asarray(eta, np.float64) - np.float64(eta0)
    dp = _dphi(np.asarray(phi, np.float64), np.float64(phi0))
    return de * de + dp * dp


def _ref_event(ev: dict):
    """Selection, HLF and LLF of ONE event with plain numpy, straight from the definitions of
    pipeline.features.delphes (its docstring); None when the event is not selected."""
    c = {coll: np.asarray(ev[f"{coll}.{key}"], np.float64) > CUT[coll] for coll, key in KIN.items()}
    cand = [(k, np.asarray(ev[f"{coll}.{key}"], np.float64)[c[coll]], np.asarray(ev[f"{coll}.Eta"])[c[coll]],
             np.asarray(ev[f"{coll}.Phi"])[c[coll]]) for k, (coll, key) in enumerate(KIN.items())]

    def sums(eta0, phi0, excl_tracks):
        out = []
        for k, pt, eta, phi in cand:
            d2 = _d2(eta, phi, eta0, phi0)
            inside = d2 < CONE2
            if excl_tracks and k == 0:
                inside &= ~(d2 < EXCL2)
            out.append(pt[inside].sum())
        return out

    best = None
    for coll, is_ele in (("Electron", 1.0), ("Muon", 0.0)):
        for j in range(len(ev[f"{coll}.PT"])):
            pt = float(ev[f"{coll}.PT"][j])
            if not pt > D.LEPTON_PT_MIN:
                continue
            eta, phi = float(ev[f"{coll}.Eta"][j]), float(ev[f"{coll}.Phi"][j])
            iso = [s / pt for s in sums(eta, phi, True)]
            if iso[0] + iso[1] + iso[2] < D.ISO_MAX and (best is None or pt > best[0]):
                best = (pt, eta, phi, float(ev[f"{coll}.Charge"][j]), is_ele, *iso)
    if best is None:
        return None
    lpt, leta, lphi, lq, is_e, ich, igam, ineu = best
    jpt, jeta = np.asarray(ev["Jet.PT"], np.float64), np.asarray(ev["Jet.Eta"], np.float64)
    good = (jpt > D.JET_PT_MIN) & (np.abs(jeta) < D.JET_ETA_MAX)
    met = float(ev["MissingET.MET"][0]) if len(ev["MissingET.MET"]) else 0.0
    phimet = float(ev["MissingET.Phi"][0]) if len(ev["MissingET.Phi"]) else 0.0
    mt = math.sqrt(max(2 * lpt * met * (1 - math.cos(lphi - phimet)), 0.0))
    hlf = [jpt[good].sum(), met, phimet, mt, good.sum(), (good & (np.asarray(ev["Jet.BTag"]) > 0)).sum(),
           lpt, leta, lphi, ich, igam, ineu, lq, is_e]

    def p4(pt, eta, phi):
        return [pt * math.cosh(eta), pt * math.cos(phi), pt * math.sin(phi), pt * math.sinh(eta), pt, eta, phi]

    rows = [p4(lpt, leta, lphi) + [0, 0, 0, ich, igam, ineu, 0, 0, 0, is_e, 1 - is_e, lq]]
    parts = []                                   # (float32 dR, row) in tracks, photons, neutrals order
    for k, (coll, key) in enumerate(KIN.items()):
        m = c[coll].copy()
        idx = np.flatnonzero(m)
        if k == 0:
            idx = idx[_d2(np.asarray(ev["EFlowTrack.Eta"])[idx], np.asarray(ev["EFlowTrack.Phi"])[idx],
                          leta, lphi) >= EXCL2]
        pts = np.asarray(ev[f"{coll}.{key}"], np.float64)
        idx = idx[np.argsort(-pts[idx], kind="stable")][:L.CAPS[("tracks", "photons", "neutrals")[k]]]
        for j in idx:
            pt, eta, phi = pts[j], float(ev[f"{coll}.Eta"][j]), float(ev[f"{coll}.Phi"][j])
            s = sums(eta, phi, False)
            s[k] -= pt
            iso = [max(v, 0.0) / pt for v in s]
            if k == 0:
                apid = abs(int(ev["EFlowTrack.PID"][j]))
                e_, m_ = float(apid == 11), float(apid == 13)
                extra = [float(ev[f"EFlowTrack.{x}"][j]) for x in "XYZ"] + iso + [1 - e_ - m_, 0, 0, e_, m_,
                                                                               float(ev["EFlowTrack.Charge"][j])]
            else:
                extra = [0, 0, 0] + iso + ([0, 0, 1, 0, 0, 0] if k == 1 else [0, 1, 0, 0, 0, 0])
            dr = np.float32(math.sqrt(_d2([eta], [phi], leta, lphi)[0]))
            parts.append((dr, p4(pt, eta, phi) + extra))
    order = np.argsort(-np.asarray([p[0] for p in parts], np.float32), kind="stable")
    rows += [parts[i][1] for i in order]
    llf = np.zeros((N, F))
    llf[:len(rows)] = rows
    return np.asarray(hlf, np.float64), llf, len(rows)


def _events_array(events: list[dict]):
    """A chunk (awkward record array of REQUIRED_BRANCHES) from per-event dicts of lists."""
    import awkward as ak

    dtypes = {"Charge": np.int32, "PID": np.int32, "BTag": np.uint32}
    out = {}
    for b in D.REQUIRED_BRANCHES:
        vals = [list(e.get(b, [])) for e in events]
        flat = np.asarray([v for x in vals for v in x], dtypes.get(b.split(".")[1], np.float32))
        out[b] = ak.unflatten(flat, np.asarray([len(x) for x in vals], np.int64))
    return ak.Array(out) if events else ak.Array({b: ak.unflatten(np.zeros(0, np.float32), np.zeros(0, np.int64))
                                                  for b in D.REQUIRED_BRANCHES})


def _event_strategy():
    """Random events: leptons around the threshold, candidates around theirs, some exactly one
    cone radius (in eta or phi, across the phi wrap too) from a lepton or from each other."""
    from hypothesis import strategies as st

    f32 = lambda lo, hi: st.floats(lo, hi, width=32, allow_nan=False)   # noqa: E731
    pt = st.one_of(f32(0.0, 80.0), st.sampled_from([0.5, 1.0, 23.0, 30.0, 40.0]))
    eta = st.one_of(f32(-2.5, 2.5), st.sampled_from([0.0, 0.3, -0.3, 0.6, 1.25]))
    phi = st.one_of(f32(-3.125, 3.125), st.sampled_from([3.0, -3.0, 0.0, 0.3, float(np.float32(math.pi))]))

    @st.composite
    def event(draw):
        ev = {}
        anchors = []
        for coll, n_max, extra in (("Electron", 2, ("Charge",)), ("Muon", 2, ("Charge",)),
                                   ("EFlowTrack", 8, ("Charge", "PID", "X", "Y", "Z")),
                                   ("EFlowPhoton", 5, ()), ("EFlowNeutralHadron", 5, ()), ("Jet", 3, ("BTag",))):
            n = draw(st.integers(0, n_max))
            key = KIN.get(coll, "PT")
            ev[f"{coll}.{key}"] = [draw(pt) for _ in range(n)]
            etas, phis = [], []
            for _ in range(n):
                if anchors and draw(st.booleans()):       # one cone radius away from an earlier object
                    a_eta, a_phi = draw(st.sampled_from(anchors))
                    d = draw(st.sampled_from([(0.3, 0.0), (-0.3, 0.0), (0.0, 0.3), (0.0, -0.3), (0.0, 0.0),
                                              (0.0005, 0.0)]))
                    etas.append(float(np.float32(a_eta + d[0])))
                    p = a_phi + d[1]
                    phis.append(float(np.float32(p - 2 * math.pi if p > math.pi else p)))
                else:
                    etas.append(draw(eta))
                    phis.append(draw(phi))
            anchors += list(zip(etas, phis))
            if coll != "Jet":
                ev[f"{coll}.Eta"], ev[f"{coll}.Phi"] = etas, phis
            else:
                ev["Jet.Eta"] = etas
            for x in extra:
                ev[f"{coll}.{x}"] = [draw(st.sampled_from({"Charge": [-1, 1], "PID": [211, -11, 13, 22, 11],
                                                           "BTag": [0, 1, 2]}.get(x, [0.0, 1.5, -2.0])))
                                     for _ in range(n)]
        met = draw(st.lists(f32(0.0, 200.0), max_size=1))
        ev["MissingET.MET"], ev["MissingET.Phi"] = met, [draw(phi) for _ in met]
        return ev

    return st.lists(event(), max_size=5)


def _compare_with_reference(events):
    block = D.compute_features(_events_array(events))
    arrs = _events_array(events)
    per_event = [{b: np.asarray(arrs[b][i]) for b in D.REQUIRED_BRANCHES} for i in range(len(events))]
    ref = [_ref_event(ev) for ev in per_event]
    assert block.n_read == len(events)
    assert block.index.tolist() == [i for i, r in enumerate(ref) if r is not None]
    for k, i in enumerate(block.index):
        hlf, llf, n = ref[i]
        np.testing.assert_allclose(block.hlf[k], hlf.astype(np.float32), rtol=1e-5, atol=1e-5)
        assert block.n_particles[k] == n
        np.testing.assert_allclose(block.llf[k].reshape(N, F), llf.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_fast_path_matches_reference_on_edge_events():
    lep = {"Muon.PT": [40.0], "Muon.Eta": [0.5], "Muon.Phi": [3.0], "Muon.Charge": [-1]}
    on_edge = {**lep, "EFlowTrack.PT": [40.0, 5.0, 2.0], "EFlowTrack.Eta": [0.5, 0.8, 0.5],
               "EFlowTrack.Phi": [3.0, 3.0, float(np.float32(3.0 + 0.3 - 2 * math.pi))],
               "EFlowTrack.Charge": [-1, 1, 1], "EFlowTrack.PID": [13, 211, 211],
               "EFlowTrack.X": [0.0, 0.1, 0.2], "EFlowTrack.Y": [0.0] * 3, "EFlowTrack.Z": [0.0] * 3,
               "EFlowPhoton.ET": [3.0], "EFlowPhoton.Eta": [0.2], "EFlowPhoton.Phi": [3.0]}
    no_candidates = {**lep}
    empty = {}
    _compare_with_reference([on_edge, no_candidates, empty])
    _compare_with_reference([])
    block = D.compute_features(_events_array([no_candidates]))
    assert block.index.tolist() == [0] and block.n_particles.tolist() == [1]   # the lepton row only


def test_fast_path_matches_reference_on_random_events():
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_event_strategy())
    def check(events):
        _compare_with_reference(events)

    check()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gru", "inclusive"])
def test_llf_output_trains_the_particle_models_through_the_shards(spark, three_samples, tmp_path, model):
    """llf/ (real particles only) -> the shard stage (padded 801 x 19 tensors) -> the particle
    models train on it with the stage's scaling.json: every row of the shards is its event's
    padded LLF, and the training takes every step of its 2 epochs with a finite test loss."""
    import pyarrow.parquet as pq

    from pipeline.data.parquet import decode_table
    from pipeline.features.stage import FeaturesConfig, build_features
    from pipeline.shards.materialize import ShardConfig, shard
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import train

    feats = tmp_path / "f"
    rep = build_features(FeaturesConfig(samples=_samples(three_samples), output=str(feats), step_size=10,
                                        test_fraction=0.2, val_fraction=0.2, seed=1), spark=spark)
    man = shard(ShardConfig(input=rep["llf"], output=str(tmp_path / "shards"), workers=1, row_group_rows=8),
                spark=spark)
    assert man["tensors"]["llf"] == {"dtype": "float32", "length": N * F}
    src = _table(rep["llf"]).set_index("sample_id")
    t = pq.read_table(man["workers"][0]["path"])
    got = decode_table(t, ["sample_id", "llf"], "shard")
    for sid, x in zip(got["sample_id"].tolist(), got["llf"].numpy()):
        real = np.asarray(src.llf[sid], np.float32)
        np.testing.assert_array_equal(x[:len(real)], real)
        assert len(real) == 19 * src.n_particles[sid] and not x[len(real):].any()
    s = train(TrainConfig(manifest=str(tmp_path / "shards" / "manifest.json"), output=str(tmp_path / "run"),
                          launcher="inprocess", model=model, epochs=2, batch_size=8, optimizer="adam", lr=0.001,
                          progress=False))
    # full batches only: 2 epochs of rows // 8 steps
    assert s["steps"] == 2 * (man["workers"][0]["rows"] // 8) >= 2 and math.isfinite(s["test_loss"]), s
