"""Delphes event selection, high-level (HLF) and low-level (LLF) features, at columnar speed.

The physics of the CERN topology-classifier pipeline (Migliorini et al. 2019, cerndb/SparkDLTrigger;
Nguyen et al. 2019) on whole chunks of events: the collections become flat (offsets, values)
numpy arrays (:func:`columns`) and numba kernels (:mod:`pipeline.features.kernels`) do the
isolation sums and the LLF construction, with the candidates sorted by eta within each event so
that a cone only scans its eta window. :func:`compute_features` takes an awkward record array with
the fields of :data:`REQUIRED_BRANCHES` (as ``tree.arrays(list(REQUIRED_BRANCHES))`` or an
ingested Parquet part gives it) and returns the selected events' features. The Spark stage
that runs it per chunk, splits, balances and writes the datasets is ``pipeline.features.stage``.
The names, caps and sizes of the feature layout live in ``pipeline.features.layout``.

Definitions (documented in docs/hep-features.md):

* Particle-flow candidates: tracks ``EFlowTrack`` with pT > 0.5 GeV, photons ``EFlowPhoton`` and
  neutral hadrons ``EFlowNeutralHadron`` with ET > 1 GeV; all treated as massless.
* Isolation of a particle: the scalar sum of the pT (ET) of the candidates of one kind within
  dR < 0.3, divided by the particle's pT, excluding the particle itself (and, for the lepton,
  its own track: any track within dR < 0.001). dR^2 = deta^2 + dphi^2 in float64 with
  dphi = (a - b + pi) mod 2 pi - pi, and "within" is dR^2 < 0.3^2. ChPFIso: tracks, GammaPFIso: photons,
  NeuPFIso: neutral hadrons.
* Selection: at least one electron or muon with pT > 23 GeV and ChPFIso + GammaPFIso + NeuPFIso
  < 0.45; the selected lepton is the highest-pT such lepton.
* HLF (14, ``layout.HLF_NAMES``): jets with pT > 30 GeV and |eta| < 2.6, b-jets with ``BTag > 0``;
  MT = sqrt(2 pT(l) MET (1 - cos dphi)).
* LLF (801 x 19, ``layout.LLF_NAMES``): row 0 the lepton; then the tracks (at most 450, the lepton's
  own track removed), photons (150) and neutral hadrons (200), each group cut to its cap by
  keeping the highest pT, together ordered by decreasing dR from the lepton; then zero rows.
  The real particles are therefore the first ``n_particles`` rows (the mask the training uses).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import CAPS, LLF_SIZE, N_HLF, N_LLF_FEATURES, N_PARTICLES

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

LEPTON_PT_MIN = 23.0
ISO_MAX = 0.45
ISO_CONE = 0.3
SELF_MATCH_DR = 1e-3
TRACK_PT_MIN = 0.5
PHOTON_ET_MIN = 1.0
NEUTRAL_ET_MIN = 1.0
JET_PT_MIN = 30.0
JET_ETA_MAX = 2.6
KIND_TRACK, KIND_PHOTON, KIND_NEUTRAL = 0, 1, 2
#: the columns of a selected lepton (:attr:`Selection.lepton`)
LEPTON_FIELDS = ("pt", "eta", "phi", "charge", "is_ele", "iso_ch", "iso_gamma", "iso_neu")


@dataclass
class Jagged:
    """One collection of a chunk: ``off`` (n + 1 offsets) and flat value columns."""

    off: np.ndarray
    cols: dict

    def __getitem__(self, name: str) -> np.ndarray:
        return self.cols[name]

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.off)


@dataclass
class Columns:
    """The REQUIRED_BRANCHES of a chunk as flat arrays, thresholds applied (see the module docstring)."""

    n: int
    tracks: Jagged      # pt eta phi charge pid x y z
    photons: Jagged     # pt eta phi
    neutrals: Jagged    # pt eta phi
    leptons: Jagged     # pt eta phi charge is_ele: electrons and muons above LEPTON_PT_MIN, electrons first
    cands: Jagged       # eta phi pt kind: all candidates, sorted by eta within each event
    jets: Jagged        # pt eta btag
    met: np.ndarray     # (n,) MET of each event (0 without a MissingET entry)
    met_phi: np.ndarray


def _jagged(arr, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """(counts, flat values) of a jagged awkward array (missing lists count as empty). A plain list
    of numbers (what uproot reads) is taken from its buffers; anything else goes through awkward."""
    import awkward as ak

    layout = ak.to_layout(arr)
    if isinstance(layout, ak.contents.ListOffsetArray) and isinstance(layout.content, ak.contents.NumpyArray) \
            and layout.content.data.ndim == 1:
        off = np.asarray(layout.offsets.data, np.int64)
        return np.diff(off), np.asarray(layout.content.data[off[0]:off[-1]], dtype)
    counts = np.asarray(ak.to_numpy(ak.fill_none(ak.num(arr, axis=1), 0)), np.int64)
    flat = ak.flatten(arr, axis=None)
    values = np.asarray(ak.to_numpy(flat), dtype) if len(flat) else np.zeros(0, dtype)
    return counts, values


def _offsets(counts: np.ndarray) -> np.ndarray:
    off = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=off[1:])
    return off


def _collection(ev, prefix: str, fields: dict, cut: tuple[str, float] | None,
                events: np.ndarray | None = None) -> Jagged:
    """``prefix.Field`` branches -> Jagged with the given column names, entries with ``cut`` (column,
    minimum, exclusive) passing; with ``events`` (bool per event) only the entries of those events
    (the others become empty)."""
    n = len(ev)
    counts, cols = None, {}
    for name, branch in fields.items():
        counts, cols[name] = _jagged(ev[f"{prefix}.{branch}"])
    if cut is None and events is None:
        return Jagged(_offsets(counts), cols)
    keep = np.ones(len(cols[next(iter(cols))]), np.bool_) if events is None else np.repeat(events, counts)
    if cut is not None:
        keep &= cols[cut[0]] > cut[1]
    evt = np.repeat(np.arange(n), counts)
    return Jagged(_offsets(np.bincount(evt[keep], minlength=n)), {k: v[keep] for k, v in cols.items()})


def _merge(groups: list[tuple[int, Jagged]], n: int) -> Jagged:
    """Concatenate collections (with their kind) and order by (event, eta); ties keep their order."""
    evt = np.concatenate([np.repeat(np.arange(n), g.counts) for _, g in groups])
    cols = {c: np.concatenate([g[c] for _, g in groups]) for c in ("eta", "phi", "pt")}
    cols["kind"] = np.concatenate([np.full(len(g["pt"]), k, np.int64) for k, g in groups])
    order = np.lexsort((cols["eta"], evt))
    return Jagged(_offsets(np.bincount(evt, minlength=n)), {c: v[order] for c, v in cols.items()})


def columns(ev, lepton_events_only: bool = False) -> Columns:
    """The flat collections of one chunk (awkward record array of REQUIRED_BRANCHES). With
    ``lepton_events_only`` the particle-flow candidates are kept only in the events with a lepton
    above LEPTON_PT_MIN (the only events :func:`select` can select; the others get none), which
    saves their sorting and copying where few events have a lepton."""
    n = len(ev)
    kin = {"pt": "PT", "eta": "Eta", "phi": "Phi"}
    ele = _collection(ev, "Electron", {**kin, "charge": "Charge"}, ("pt", LEPTON_PT_MIN))
    mu = _collection(ev, "Muon", {**kin, "charge": "Charge"}, ("pt", LEPTON_PT_MIN))
    ele.cols["is_ele"], mu.cols["is_ele"] = np.ones(len(ele["pt"])), np.zeros(len(mu["pt"]))
    evt = np.concatenate([np.repeat(np.arange(n), ele.counts), np.repeat(np.arange(n), mu.counts)])
    order = np.argsort(evt, kind="stable")                     # per event: electrons, then muons
    leptons = Jagged(_offsets(np.bincount(evt, minlength=n)),
                     {c: np.concatenate([ele[c], mu[c]])[order] for c in ele.cols})
    has = leptons.counts > 0 if lepton_events_only else None
    tracks = _collection(ev, "EFlowTrack", {**kin, "charge": "Charge", "pid": "PID", "x": "X", "y": "Y", "z": "Z"},
                         ("pt", TRACK_PT_MIN), has)
    photons = _collection(ev, "EFlowPhoton", {"pt": "ET", "eta": "Eta", "phi": "Phi"}, ("pt", PHOTON_ET_MIN), has)
    neutrals = _collection(ev, "EFlowNeutralHadron", {"pt": "ET", "eta": "Eta", "phi": "Phi"},
                           ("pt", NEUTRAL_ET_MIN), has)
    jets = _collection(ev, "Jet", {"pt": "PT", "eta": "Eta", "btag": "BTag"}, None)
    met = _collection(ev, "MissingET", {"met": "MET", "phi": "Phi"}, None)
    met_has = met.counts > 0
    first = met.off[:-1][met_has]                              # the first MissingET entry of each event
    met_val, met_phi = np.zeros(n), np.zeros(n)
    met_val[met_has], met_phi[met_has] = met["met"][first], met["phi"][first]
    cands = _merge([(KIND_TRACK, tracks), (KIND_PHOTON, photons), (KIND_NEUTRAL, neutrals)], n)
    return Columns(n, tracks, photons, neutrals, leptons, cands, jets, met_val, met_phi)


@dataclass
class Selection:
    """Per-chunk selection result: ``index`` of the selected events and their lepton."""

    index: np.ndarray          # positions (within the chunk) of the selected events
    lepton: np.ndarray         # (k, 8) float64, columns LEPTON_FIELDS
    n_candidates: int          # events with at least one lepton above the pT threshold


def select(cols: Columns) -> Selection:
    """Events with at least one isolated lepton (pT > 23 GeV, relative PF isolation < 0.45); the
    highest-pT such lepton (ties: electrons first, then in branch order)."""
    from . import kernels as K

    lp, c = cols.leptons, cols.cands
    chosen, lep = K.select_leptons(lp.off, lp["pt"], lp["eta"], lp["phi"], lp["charge"], lp["is_ele"],
                                   c.off, c["eta"], c["phi"], c["pt"], c["kind"], ISO_CONE, SELF_MATCH_DR ** 2,
                                   ISO_MAX)
    index = np.flatnonzero(chosen)
    return Selection(index, lep[index], int((lp.counts > 0).sum()))


def select_events(ev) -> Selection:
    """:func:`select` on an awkward chunk."""
    return select(columns(ev, lepton_events_only=True))


def _dphi(a, b):
    return (np.asarray(a) - b + np.pi) % (2 * np.pi) - np.pi


def high_level(cols: Columns, sel: Selection) -> np.ndarray:
    """(k, N_HLF) float32 HLF of the selected events."""
    j = cols.jets
    evt = np.repeat(np.arange(cols.n), j.counts)
    good = (j["pt"] > JET_PT_MIN) & (np.abs(j["eta"]) < JET_ETA_MAX)
    ht = np.bincount(evt[good], weights=j["pt"][good], minlength=cols.n)[sel.index]
    njets = np.bincount(evt[good], minlength=cols.n)[sel.index]
    nb = np.bincount(evt[good & (j["btag"] > 0)], minlength=cols.n)[sel.index]
    met, phimet = cols.met[sel.index], cols.met_phi[sel.index]
    lep = sel.lepton
    mt = np.sqrt(np.maximum(2.0 * lep[:, 0] * met * (1.0 - np.cos(_dphi(lep[:, 2], phimet))), 0.0))
    out = np.column_stack([ht, met, phimet, mt, njets, nb, lep[:, 0], lep[:, 1], lep[:, 2], lep[:, 5], lep[:, 6],
                           lep[:, 7], lep[:, 3], lep[:, 4]])
    return out.astype(np.float32).reshape(len(sel.index), N_HLF)


def low_level(cols: Columns, index: np.ndarray, lepton: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """((k, LLF_SIZE) float32 LLF flattened particle-major, (k,) int32 count of real particles) of the
    events ``index`` with leptons ``lepton`` ((k, 8), columns LEPTON_FIELDS)."""
    from . import kernels as K

    k = len(index)
    out = np.zeros((k, N_PARTICLES, N_LLF_FEATURES), np.float32)
    npart = np.zeros(k, np.int32)
    t, p, nh, c = cols.tracks, cols.photons, cols.neutrals, cols.cands
    caps = np.array([CAPS["tracks"], CAPS["photons"], CAPS["neutrals"]], np.int64)
    if k:
        K.low_level(np.asarray(index, np.int64), np.ascontiguousarray(lepton, np.float64),
                    t.off, t["pt"], t["eta"], t["phi"], t["charge"], t["pid"], t["x"], t["y"], t["z"],
                    p.off, p["pt"], p["eta"], p["phi"], nh.off, nh["pt"], nh["eta"], nh["phi"],
                    c.off, c["eta"], c["phi"], c["pt"], c["kind"], caps, ISO_CONE, SELF_MATCH_DR ** 2, out, npart)
    return out.reshape(k, LLF_SIZE), npart


@dataclass
class FeatureBlock:
    """Features of the selected events of one chunk."""

    index: np.ndarray          # positions of the selected events within the chunk
    hlf: np.ndarray            # (n, N_HLF) float32
    llf: np.ndarray            # (n, LLF_SIZE) float32
    n_particles: np.ndarray    # (n,) int32
    n_read: int


def compute_features(ev) -> FeatureBlock:
    """Selection + HLF + LLF of one chunk of events (awkward record array of REQUIRED_BRANCHES)."""
    cols = columns(ev, lepton_events_only=True)
    sel = select(cols)
    llf, npart = low_level(cols, sel.index, sel.lepton)
    return FeatureBlock(sel.index, high_level(cols, sel), llf, npart, cols.n)
