"""Delphes event selection, high-level (HLF) and low-level (LLF) features, vectorised.

The physics of the CERN topology-classifier pipeline (Migliorini et al. 2019, cerndb/SparkDLTrigger;
Nguyen et al. 2019), written with awkward arrays and scikit-hep ``vector`` on whole chunks of
events (no per-event Python loop). :func:`compute_features` takes an awkward record array with
the fields of :data:`REQUIRED_BRANCHES` (as ``tree.arrays(list(REQUIRED_BRANCHES))`` or an
ingested Parquet part gives it) and returns the selected events' features. The Spark stage
that runs it per chunk, splits, balances and writes the datasets is ``pipeline.features.stage``
(:func:`build_features` here is its entry point).

Definitions (documented in README.md (HEP path)):

* Particle-flow candidates: tracks ``EFlowTrack`` with pT > 0.5 GeV, photons ``EFlowPhoton`` and
  neutral hadrons ``EFlowNeutralHadron`` with ET > 1 GeV; all treated as massless.
* Isolation of a particle: the scalar sum of the pT (ET) of the candidates of one kind within
  dR < 0.3, divided by the particle's pT, excluding the particle itself (and, for the lepton,
  its own track: any track within dR < 0.001). ChPFIso: tracks, GammaPFIso: photons,
  NeuPFIso: neutral hadrons.
* Selection: at least one electron or muon with pT > 23 GeV and ChPFIso + GammaPFIso + NeuPFIso
  < 0.45; the selected lepton is the highest-pT such lepton.
* HLF (14, :data:`HLF_NAMES`): jets with pT > 30 GeV and |eta| < 2.6, b-jets with ``BTag > 0``;
  MT = sqrt(2 pT(l) MET (1 - cos dphi)).
* LLF (801 x 19, :data:`LLF_NAMES`): row 0 the lepton; then the tracks (at most 450, the lepton's
  own track removed), photons (150) and neutral hadrons (200), each group cut to its cap by
  keeping the highest pT, together ordered by decreasing dR from the lepton; then zero rows.
  The real particles are therefore the first ``n_particles`` rows (the mask the training uses).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: The branches the feature stage reads (name -> meaning). Any Delphes-layout tree that has
#: them works: a real Delphes 3 file or one written by uproot (pipeline.simulate).
REQUIRED_BRANCHES: dict[str, str] = {
    "Electron.PT": "electron transverse momentum [GeV]",
    "Electron.Eta": "electron pseudorapidity",
    "Electron.Phi": "electron azimuth [rad]",
    "Electron.Charge": "electron charge (+1/-1)",
    "Muon.PT": "muon transverse momentum [GeV]",
    "Muon.Eta": "muon pseudorapidity",
    "Muon.Phi": "muon azimuth [rad]",
    "Muon.Charge": "muon charge (+1/-1)",
    "Jet.PT": "jet transverse momentum [GeV]",
    "Jet.Eta": "jet pseudorapidity",
    "Jet.BTag": "jet b-tag bits (> 0: b-tagged)",
    "MissingET.MET": "missing transverse energy [GeV] (one entry per event)",
    "MissingET.Phi": "azimuth of the missing transverse energy [rad]",
    "EFlowTrack.PT": "particle-flow track transverse momentum [GeV]; the leptons' own tracks included, "
                     "at the lepton's eta/phi",
    "EFlowTrack.Eta": "track pseudorapidity",
    "EFlowTrack.Phi": "track azimuth [rad]",
    "EFlowTrack.Charge": "track charge",
    "EFlowTrack.PID": "PDG id of the particle that made the track (|11| electron, |13| muon, else hadron)",
    "EFlowTrack.X": "track production vertex x [mm]",
    "EFlowTrack.Y": "track production vertex y [mm]",
    "EFlowTrack.Z": "track production vertex z [mm]",
    "EFlowPhoton.ET": "particle-flow photon transverse energy [GeV]",
    "EFlowPhoton.Eta": "photon pseudorapidity",
    "EFlowPhoton.Phi": "photon azimuth [rad]",
    "EFlowNeutralHadron.ET": "particle-flow neutral hadron transverse energy [GeV]",
    "EFlowNeutralHadron.Eta": "neutral hadron pseudorapidity",
    "EFlowNeutralHadron.Phi": "neutral hadron azimuth [rad]",
}

HLF_NAMES = ["HT", "MET", "phiMET", "MT", "nJets", "nBjets", "LepPt", "LepEta", "LepPhi",
             "LepIsoCh", "LepIsoGamma", "LepIsoNeu", "LepCharge", "LepIsEle"]
LLF_NAMES = ["Energy", "Px", "Py", "Pz", "Pt", "Eta", "Phi", "vtxX", "vtxY", "vtxZ", "ChPFIso", "GammaPFIso",
             "NeuPFIso", "isChHad", "isNeuHad", "isGamma", "isEle", "isMu", "Charge"]
N_HLF, N_LLF_FEATURES = len(HLF_NAMES), len(LLF_NAMES)
CAPS = {"tracks": 450, "photons": 150, "neutrals": 200}
N_PARTICLES = 1 + sum(CAPS.values())          # 801
LLF_SIZE = N_PARTICLES * N_LLF_FEATURES        # 15,219

LEPTON_PT_MIN = 23.0
ISO_MAX = 0.45
ISO_CONE = 0.3
SELF_MATCH_DR = 1e-3
TRACK_PT_MIN = 0.5
PHOTON_ET_MIN = 1.0
NEUTRAL_ET_MIN = 1.0
JET_PT_MIN = 30.0
JET_ETA_MAX = 2.6
#: at most this many (particle, candidate) pairs are materialised at once for the isolation sums
PAIR_BUDGET = 4_000_000

_KIND_TRACK, _KIND_PHOTON, _KIND_NEUTRAL = 0, 1, 2


def _ak():
    import awkward as ak
    import vector

    vector.register_awkward()
    return ak


def _p4(pt, eta, phi):
    """Massless Momentum4D records (scikit-hep vector behaviour)."""
    ak = _ak()
    return ak.zip({"pt": pt, "eta": eta, "phi": phi, "mass": ak.zeros_like(pt)}, with_name="Momentum4D")


def candidates(ev) -> dict:
    """The particle-flow candidates passing the pT/ET thresholds, as jagged records."""
    ak = _ak()
    trk = ak.zip({"pt": ev["EFlowTrack.PT"], "eta": ev["EFlowTrack.Eta"], "phi": ev["EFlowTrack.Phi"],
                  "charge": ev["EFlowTrack.Charge"], "pid": ev["EFlowTrack.PID"], "x": ev["EFlowTrack.X"],
                  "y": ev["EFlowTrack.Y"], "z": ev["EFlowTrack.Z"]})
    pho = ak.zip({"pt": ev["EFlowPhoton.ET"], "eta": ev["EFlowPhoton.Eta"], "phi": ev["EFlowPhoton.Phi"]})
    neu = ak.zip({"pt": ev["EFlowNeutralHadron.ET"], "eta": ev["EFlowNeutralHadron.Eta"],
                  "phi": ev["EFlowNeutralHadron.Phi"]})
    return {"tracks": trk[trk.pt > TRACK_PT_MIN], "photons": pho[pho.pt > PHOTON_ET_MIN],
            "neutrals": neu[neu.pt > NEUTRAL_ET_MIN]}


def _all_candidates(c: dict):
    """Tracks, photons and neutral hadrons in one jagged list with a ``kind`` field."""
    ak = _ak()
    parts = []
    for kind, name in ((_KIND_TRACK, "tracks"), (_KIND_PHOTON, "photons"), (_KIND_NEUTRAL, "neutrals")):
        x = c[name]
        parts.append(ak.zip({"pt": ak.values_astype(x.pt, np.float64), "eta": x.eta, "phi": x.phi,
                             "kind": ak.values_astype(ak.zeros_like(x.pt), np.int8) + kind}))
    return ak.concatenate(parts, axis=1)


def cone_sums(obj, cands, exclude_dr: float = 0.0):
    """Per object (jagged like ``obj``): the pT sum of ``cands`` of each kind within dR < ISO_CONE.

    Returns three jagged float64 arrays (tracks, photons, neutral hadrons). Candidates closer
    than ``exclude_dr`` are left out (the lepton's own track). The (object, candidate) pairs are
    built with ``ak.cartesian`` on slices of events holding at most :data:`PAIR_BUDGET` pairs.
    """
    ak = _ak()
    n = len(obj)
    if n == 0:
        empty = obj.pt[:0] * 1.0
        return empty, empty, empty
    pairs = ak.to_numpy(ak.num(obj, axis=1)).astype(np.int64) * ak.to_numpy(ak.num(cands, axis=1))
    cuts, acc, start = [0], 0, 0
    for i, p in enumerate(pairs):  # noqa: this loop only cuts the event range into slices
        if acc and acc + p > PAIR_BUDGET:
            cuts.append(i)
            acc = 0
        acc += p
    cuts.append(n)
    out = [[], [], []]
    for a, b in zip(cuts[:-1], cuts[1:]):
        o4 = _p4(obj.pt[a:b], obj.eta[a:b], obj.phi[a:b])
        cs = cands[a:b]
        c4 = ak.zip({"pt": cs.pt, "eta": cs.eta, "phi": cs.phi, "mass": ak.zeros_like(cs.pt), "kind": cs.kind},
                    with_name="Momentum4D")
        o, c = ak.unzip(ak.cartesian([o4, c4], nested=True))
        dr2 = o.deltaR2(c)
        inside = dr2 < ISO_CONE ** 2
        if exclude_dr > 0:
            inside = inside & (dr2 >= exclude_dr ** 2)
        for k in range(3):
            out[k].append(ak.sum(ak.where(inside & (c.kind == k), c.pt, 0.0), axis=-1))
    return tuple(ak.concatenate(x, axis=0) if len(x) > 1 else x[0] for x in out)


def lepton_candidates(ev):
    """Electrons and muons with pT > 23 GeV, highest pT first (fields pt, eta, phi, charge, is_ele)."""
    ak = _ak()
    ele = ak.zip({"pt": ev["Electron.PT"], "eta": ev["Electron.Eta"], "phi": ev["Electron.Phi"],
                  "charge": ak.values_astype(ev["Electron.Charge"], np.float32),
                  "is_ele": ak.ones_like(ev["Electron.PT"])})
    mu = ak.zip({"pt": ev["Muon.PT"], "eta": ev["Muon.Eta"], "phi": ev["Muon.Phi"],
                 "charge": ak.values_astype(ev["Muon.Charge"], np.float32),
                 "is_ele": ak.zeros_like(ev["Muon.PT"])})
    leps = ak.concatenate([ele, mu], axis=1)
    leps = leps[leps.pt > LEPTON_PT_MIN]
    return leps[ak.argsort(leps.pt, axis=1, ascending=False, stable=True)]


@dataclass
class Selection:
    """Per-chunk selection result: ``index`` of the selected events and their lepton."""

    index: np.ndarray          # positions (within the chunk) of the selected events
    lepton: Any                # awkward records: pt, eta, phi, charge, is_ele, iso_ch, iso_gamma, iso_neu
    n_candidates: int          # events with at least one lepton above the pT threshold


def select_events(ev, cands: dict | None = None) -> Selection:
    """Events with at least one isolated lepton (pT > 23 GeV, relative PF isolation < 0.45)."""
    ak = _ak()
    leps = lepton_candidates(ev)
    has = np.flatnonzero(ak.to_numpy(ak.num(leps, axis=1)) > 0)
    if len(has) == 0:
        return Selection(np.zeros(0, np.int64), None, 0)
    cands = cands or candidates(ev)
    allc = _all_candidates({k: v[has] for k, v in cands.items()})
    leps = leps[has]
    ch, gam, neu = cone_sums(leps, allc, exclude_dr=SELF_MATCH_DR)
    pt = ak.values_astype(leps.pt, np.float64)
    leps = ak.with_field(leps, ch / pt, "iso_ch")
    leps = ak.with_field(leps, gam / pt, "iso_gamma")
    leps = ak.with_field(leps, neu / pt, "iso_neu")
    isolated = leps[(leps.iso_ch + leps.iso_gamma + leps.iso_neu) < ISO_MAX]
    lep = ak.firsts(isolated)                       # highest-pT isolated lepton, None if none
    ok = ~ak.to_numpy(ak.is_none(lep))
    return Selection(has[ok], lep[ok], len(has))


def high_level(ev, lep) -> np.ndarray:
    """(n, 14) float32 HLF of the selected events ``ev`` with their lepton ``lep``."""
    ak = _ak()
    jpt, jeta = ev["Jet.PT"], ev["Jet.Eta"]
    good = (jpt > JET_PT_MIN) & (abs(jeta) < JET_ETA_MAX)
    ht = ak.sum(ak.where(good, jpt, 0.0), axis=1)
    njets = ak.sum(good, axis=1)
    nb = ak.sum(good & (ev["Jet.BTag"] > 0), axis=1)
    met = ak.fill_none(ak.firsts(ev["MissingET.MET"]), 0.0)
    phimet = ak.fill_none(ak.firsts(ev["MissingET.Phi"]), 0.0)
    l4 = _p4(lep.pt, lep.eta, lep.phi)
    m4 = _p4(met, ak.zeros_like(met), phimet)
    mt = np.sqrt(np.maximum(2.0 * l4.pt * m4.pt * (1.0 - np.cos(l4.deltaphi(m4))), 0.0))
    cols = [ht, met, phimet, mt, njets, nb, lep.pt, lep.eta, lep.phi, lep.iso_ch, lep.iso_gamma, lep.iso_neu,
            lep.charge, lep.is_ele]
    return np.stack([ak.to_numpy(c).astype(np.float64) for c in cols], axis=1).astype(np.float32)


def _cap(x, n: int):
    ak = _ak()
    return x[ak.argsort(x.pt, axis=1, ascending=False, stable=True)][:, :n]


def particles(ev, lep, cands: dict):
    """The LLF particles of the selected events (without the lepton row), ordered, as 19-field records."""
    ak = _ak()
    l4 = _p4(lep.pt, lep.eta, lep.phi)
    trk = cands["tracks"]
    trk = trk[l4.deltaR(_p4(trk.pt, trk.eta, trk.phi)) >= SELF_MATCH_DR]   # drop the lepton's own track
    groups = {"tracks": _cap(trk, CAPS["tracks"]), "photons": _cap(cands["photons"], CAPS["photons"]),
              "neutrals": _cap(cands["neutrals"], CAPS["neutrals"])}
    allc = _all_candidates(cands)
    recs = []
    for kind, name in ((_KIND_TRACK, "tracks"), (_KIND_PHOTON, "photons"), (_KIND_NEUTRAL, "neutrals")):
        g = groups[name]
        p4 = _p4(g.pt, g.eta, g.phi)
        sums = list(cone_sums(g, allc))
        pt = ak.values_astype(g.pt, np.float64)
        sums[kind] = np.maximum(sums[kind] - pt, 0.0)         # the particle itself is not its isolation
        zero = ak.zeros_like(g.pt)
        if kind == _KIND_TRACK:
            apid = abs(g.pid)
            is_e, is_m = ak.values_astype(apid == 11, np.float32), ak.values_astype(apid == 13, np.float32)
            flags = (1.0 - is_e - is_m, zero, zero, is_e, is_m)
            vtx, charge = (g.x, g.y, g.z), g.charge
        else:
            one = ak.ones_like(g.pt)
            flags = (zero, one, zero, zero, zero) if kind == _KIND_NEUTRAL else (zero, zero, one, zero, zero)
            vtx, charge = (zero, zero, zero), zero
        vals = [p4.E, p4.px, p4.py, p4.pz, g.pt, g.eta, g.phi, *vtx, sums[0] / pt, sums[1] / pt, sums[2] / pt,
                *flags, charge]
        rec = ak.zip({n: ak.values_astype(v, np.float32) for n, v in zip(LLF_NAMES, vals)})
        recs.append(ak.with_field(rec, ak.values_astype(l4.deltaR(p4), np.float32), "_dr"))
    parts = ak.concatenate(recs, axis=1)
    return parts[ak.argsort(parts["_dr"], axis=1, ascending=False, stable=True)]


def lepton_row(lep) -> np.ndarray:
    """(n, 19) LLF rows of the selected leptons."""
    ak = _ak()
    l4 = _p4(lep.pt, lep.eta, lep.phi)
    n = len(lep)
    z = np.zeros(n)
    is_e = ak.to_numpy(lep.is_ele).astype(np.float64)
    cols = [l4.E, l4.px, l4.py, l4.pz, lep.pt, lep.eta, lep.phi, z, z, z, lep.iso_ch, lep.iso_gamma, lep.iso_neu,
            z, z, z, is_e, 1.0 - is_e, lep.charge]
    return np.stack([np.asarray(ak.to_numpy(c) if not isinstance(c, np.ndarray) else c, dtype=np.float64)
                     for c in cols], axis=1).astype(np.float32)


def low_level(ev, lep, cands: dict) -> tuple[np.ndarray, np.ndarray]:
    """((n, 15219) float32 LLF flattened particle-major, (n,) int32 count of real particles)."""
    ak = _ak()
    n = len(lep)
    out = np.zeros((n, N_PARTICLES, N_LLF_FEATURES), np.float32)
    out[:, 0, :] = lepton_row(lep)
    parts = particles(ev, lep, cands)
    counts = ak.to_numpy(ak.num(parts, axis=1)).astype(np.int64)
    if counts.sum():
        flat = np.stack([ak.to_numpy(ak.flatten(parts[f])) for f in LLF_NAMES], axis=1)
        rows = np.repeat(np.arange(n), counts)
        slot = ak.to_numpy(ak.flatten(ak.local_index(parts, axis=1))) + 1
        out[rows, slot, :] = flat
    return out.reshape(n, LLF_SIZE), (counts + 1).astype(np.int32)


@dataclass
class FeatureBlock:
    """Features of the selected events of one chunk."""

    index: np.ndarray          # positions of the selected events within the chunk
    hlf: np.ndarray            # (n, 14) float32
    llf: np.ndarray            # (n, 15219) float32
    n_particles: np.ndarray    # (n,) int32
    n_read: int


def compute_features(ev) -> FeatureBlock:
    """Selection + HLF + LLF of one chunk of events (awkward record array of REQUIRED_BRANCHES)."""
    n_read = len(ev)
    cands = candidates(ev)
    sel = select_events(ev, cands)
    k = len(sel.index)
    if k == 0:
        return FeatureBlock(sel.index, np.zeros((0, N_HLF), np.float32), np.zeros((0, LLF_SIZE), np.float32),
                            np.zeros(0, np.int32), n_read)
    sub = ev[sel.index]
    subc = {name: c[sel.index] for name, c in cands.items()}
    hlf = high_level(sub, sel.lepton)
    llf, npart = low_level(sub, sel.lepton, subc)
    return FeatureBlock(sel.index, hlf, llf, npart, n_read)


def build_features(cfg, spark=None) -> dict:
    """Run the feature stage (see :mod:`pipeline.features.stage`); returns per-file counts and paths."""
    from .stage import build_features as _run

    return _run(cfg, spark=spark)


def __getattr__(name: str):
    """``FeaturesConfig`` lives in :mod:`pipeline.features.stage`; importable from here too."""
    if name == "FeaturesConfig":
        from .stage import FeaturesConfig
        return FeaturesConfig
    raise AttributeError(name)
