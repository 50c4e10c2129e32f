"""A simple particle-level detector model, vectorised over many events at once.

Input: whole Pythia event records of many events (awkward, from ``Pythia.nextBatch``).
Output: Delphes-like collections (flat numpy columns + per-event counts, see
:mod:`pipeline.simulate.delphes_io`). The model (all numbers in :class:`DetectorConfig`):

1. **Final state.** Particles with status > 0. Neutrinos (12, 14, 16) are invisible.
2. **Heavy-flavour ancestry.** A particle descends from a B (C) hadron if following ``mother1``
   links through the decay chain reaches a hadron with a b (c) quark; computed for the whole
   record at once by iterating ``flag |= flag[mother1]`` until nothing changes.
3. **Tracks** (``EFlowTrack``): charged particles with |eta| < track_eta_max and pT > track_pt_min,
   with the production vertex as X/Y/Z/T and straight-line impact parameters D0/DZ.
   Charged particles outside the tracker but inside the calorimeter deposit their energy there:
   electrons as photons, hadrons as neutral hadrons; muons outside the tracker are lost.
4. **Calorimeter candidates**: photons -> ``EFlowPhoton``; neutral hadrons (n, K0L, and K0S/Lambda,
   which are stable at c*tau > 10 mm) -> ``EFlowNeutralHadron``; both with |eta| < calo_eta_max
   and ET > calo_et_min.
5. **Smearing** (optional, :class:`SmearingConfig`): each candidate's four-momentum is scaled by
   a Gaussian factor 1 + N(0, sigma) before any threshold, jet or MET is computed.
6. **Leptons** (``Electron``, ``Muon``): tracks of electrons / muons with pT > lepton_pt_min and
   |eta| < lepton_eta_max, kept with probability electron_efficiency / muon_efficiency. Isolation
   sums as in Delphes: SumPtCharged (other tracks) and SumPtNeutral (photons + neutral hadrons)
   within dR < isolation_cone; IsolationVar = (SumPtCharged + SumPtNeutral) / PT (no pile-up, so
   IsolationVarRhoCorr = IsolationVar and SumPtChargedPU = 0).
7. **Jets** (``Jet``): anti-kt (jet_radius) on all EFlow candidates, pT > jet_pt_min, sorted by pT.
   Flavor = 5 if a constituent descends from a B hadron, else 4 for a C hadron, else 0.
   BTag (bit 0) with probability btag_efficiency / btag_mistag_c / btag_mistag_light by flavour,
   only for |eta| < btag_eta_max.
8. **Missing ET** (``MissingET``): minus the vector sum of all EFlow candidates.

Random numbers (smearing, efficiencies, b-tags) come from the task's numpy Generator in a fixed
order, so a task's output is a pure function of its seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DetectorConfig
from .generator import quiet_stdout

C_LIGHT_MM_PER_S = 2.99792458e11
KIND_TRACK, KIND_PHOTON, KIND_NEUTRAL = 0, 1, 2
_FASTJET_BANNER_SHOWN = False


@dataclass
class Collections:
    """Per-collection flat columns (numpy) and per-event counts: ``cols[name][field]``, ``counts[name]``."""

    n_events: int
    cols: dict
    counts: dict


def _flat(arr) -> np.ndarray:
    import awkward as ak

    return np.asarray(ak.to_numpy(ak.flatten(arr, axis=None)))


def _heavy_flavour_of(pdg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(has_b, has_c) for hadron PDG ids (quarks, leptons, diquarks and bosons give False)."""
    a = np.abs(pdg)
    x = a % 10000
    hadron = (x > 100) & ((x // 10) % 10 != 0) & (a < 1_000_000)
    q1, q2 = (x // 1000) % 10, (x // 100) % 10
    has_b = hadron & ((q1 == 5) | (q2 == 5))
    has_c = hadron & ~has_b & ((q1 == 4) | (q2 == 4))
    return has_b, has_c


def ancestry_flags(pdg: np.ndarray, mother1_global: np.ndarray, max_iter: int = 64):
    """Flags (from_b, from_c) for every particle: it is, or descends through mother1 links from,
    a B (C) hadron. ``mother1_global`` indexes the flat array (a particle without mother points
    at itself)."""
    from_b, from_c = _heavy_flavour_of(pdg)
    for _ in range(max_iter):
        nb = from_b | from_b[mother1_global]
        nc = from_c | from_c[mother1_global]
        if np.array_equal(nb, from_b) and np.array_equal(nc, from_c):
            break
        from_b, from_c = nb, nc
    return from_b, from_c


def _pt_eta_phi(px, py, pz):
    pt = np.hypot(px, py)
    with np.errstate(divide="ignore", invalid="ignore"):
        eta = np.arcsinh(pz / pt)
    eta = np.where(pt > 0, eta, np.copysign(999.9, pz))     # along the beam: outside every acceptance
    return pt, eta, np.arctan2(py, px)


def _delta_phi(a, b):
    return (a - b + np.pi) % (2 * np.pi) - np.pi


def _smear_factor(rng, sigma):
    return np.clip(1.0 + rng.standard_normal(len(sigma)) * sigma, 0.0, None)


def _segment_index(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments of the given lengths: (segment id, position inside the segment) of every element."""
    seg = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    pos = np.arange(int(counts.sum())) - np.repeat(starts, counts)
    return seg, pos


def simulate_detector(prt, info, cfg: DetectorConfig, rng: np.random.Generator, charge_of,
                      first_event_number: int = 0, process_id: int = 0) -> Collections:
    """Run the detector model on ``prt`` (``n * var * particle`` awkward records) -> :class:`Collections`.

    ``charge_of(pdg_ids) -> charges`` gives the electric charge of PDG ids (from Pythia's particle data).
    Steps 1-8 of the module docstring, in this order (the random draws too).
    """
    n_ev = len(prt)
    fs = _final_state(prt, charge_of)
    fs["kind"] = _classify(fs, cfg)
    c = _candidates(fs, cfg, rng, n_ev)
    cols, cnts = {}, {}
    for name, (fields, mask) in _eflow(c).items():
        cols[name] = fields
        cnts[name] = np.bincount(c["evt"][mask], minlength=n_ev).astype(np.int64)
    for name, pid, eff in (("Electron", 11, cfg.electron_efficiency), ("Muon", 13, cfg.muon_efficiency)):
        cols[name], lev = _leptons(c, cfg, rng, pid, eff)
        cnts[name] = np.bincount(lev, minlength=n_ev).astype(np.int64)
    cols["Jet"], cnts["Jet"] = _jets(cfg, rng, n_ev, c["n"], c["start"], c["px"], c["py"], c["pz"], c["e"],
                                     c["kind"], c["q"], c["pdg"], c["from_b"], c["from_c"])
    cols["MissingET"] = _missing_et(c, n_ev)
    cols["Event"] = _event_info(info, n_ev, first_event_number, process_id)
    cnts["MissingET"], cnts["Event"] = np.ones(n_ev, dtype=np.int64), np.ones(n_ev, dtype=np.int64)
    return Collections(n_events=n_ev, cols=cols, counts=cnts)


def _final_state(prt, charge_of) -> dict:
    """Flat columns of the final-state particles (status > 0) with their heavy-flavour ancestry."""
    import awkward as ak

    n_ev = len(prt)
    counts = ak.to_numpy(ak.num(prt, axis=1)).astype(np.int64)
    starts = np.cumsum(counts) - counts
    evt_all = np.repeat(np.arange(n_ev), counts)
    pdg = _flat(prt.id).astype(np.int64)
    m1 = _flat(prt.mother1).astype(np.int64)
    m1g = np.where(m1 > 0, m1 + starts[evt_all], np.arange(len(m1)))
    from_b, from_c = ancestry_flags(pdg, m1g)
    final = _flat(prt.status) > 0
    vtx = ak.fill_none(prt.vProd, {"px": 0.0, "py": 0.0, "pz": 0.0, "e": 0.0})
    fs = {"pdg": pdg[final], "evt": evt_all[final], "from_b": from_b[final], "from_c": from_c[final]}
    for name, arr in (("px", prt.p.px), ("py", prt.p.py), ("pz", prt.p.pz), ("e", prt.p.e),
                      ("vx", vtx.px), ("vy", vtx.py), ("vz", vtx.pz), ("vt", vtx.e)):
        fs[name] = _flat(arr)[final]
    fs["q"] = charge_of(fs["pdg"])
    fs["pt"], fs["eta"], fs["phi"] = _pt_eta_phi(fs["px"], fs["py"], fs["pz"])
    return fs


def _classify(fs: dict, cfg: DetectorConfig) -> np.ndarray:
    """The EFlow kind of every final-state particle (-1: not seen)."""
    apdg, aeta, charge = np.abs(fs["pdg"]), np.abs(fs["eta"]), fs["q"]
    invisible = np.isin(apdg, (12, 14, 16))
    charged = (charge != 0) & ~invisible
    in_tracker = charged & (aeta < cfg.track_eta_max)
    in_calo_only = charged & ~in_tracker & (aeta < cfg.calo_eta_max)
    kind = np.full(len(apdg), -1, dtype=np.int8)
    kind[in_tracker] = KIND_TRACK
    kind[(apdg == 22) | (in_calo_only & (apdg == 11))] = KIND_PHOTON
    neutral_had = ~charged & ~invisible & (apdg != 22)
    kind[neutral_had | (in_calo_only & (apdg != 11) & (apdg != 13))] = KIND_NEUTRAL
    kind[(kind != KIND_TRACK) & (aeta >= cfg.calo_eta_max)] = -1
    return kind


def _candidates(fs: dict, cfg: DetectorConfig, rng: np.random.Generator, n_ev: int) -> dict:
    """Smear the four-momenta, apply the thresholds: the event-ordered table of all EFlow candidates,
    with ``n`` (candidates per event) and ``start`` (first candidate of each event)."""
    kind, pt, e = fs["kind"], fs["pt"], fs["e"]
    sm = cfg.smearing
    px, py, pz = fs["px"], fs["py"], fs["pz"]
    if sm.enabled:
        f = np.ones(len(kind))
        t = kind == KIND_TRACK
        f[t] = _smear_factor(rng, np.hypot(sm.track_a, sm.track_b * pt[t]))
        g = kind == KIND_PHOTON
        f[g] = _smear_factor(rng, np.hypot(sm.photon_stochastic / np.sqrt(np.maximum(e[g], 1e-9)),
                                           sm.photon_constant))
        h = kind == KIND_NEUTRAL
        f[h] = _smear_factor(rng, np.hypot(sm.hadron_stochastic / np.sqrt(np.maximum(e[h], 1e-9)),
                                           sm.hadron_constant))
        px, py, pz, e, pt = px * f, py * f, pz * f, e * f, pt * f
    et = np.where(e > 0, e * pt / np.maximum(np.sqrt(pt ** 2 + pz ** 2), 1e-12), 0.0)
    keep = ((kind == KIND_TRACK) & (pt > cfg.track_pt_min)) | \
           (((kind == KIND_PHOTON) | (kind == KIND_NEUTRAL)) & (et > cfg.calo_et_min))
    c = {"px": px[keep], "py": py[keep], "pz": pz[keep], "e": e[keep], "pt": pt[keep], "et": et[keep]}
    for name in ("evt", "kind", "eta", "phi", "pdg", "q", "from_b", "from_c", "vx", "vy", "vz", "vt"):
        c[name] = fs[name][keep]
    c["n"] = np.bincount(c["evt"], minlength=n_ev).astype(np.int64)
    c["start"] = np.cumsum(c["n"]) - c["n"]
    return c


def _eflow(c: dict) -> dict:
    """{collection: (fields, mask over the candidates)} of EFlowTrack, EFlowPhoton, EFlowNeutralHadron."""
    tr = c["kind"] == KIND_TRACK
    px, py, pz, pt = c["px"][tr], c["py"][tr], c["pz"][tr], c["pt"][tr]
    p = np.sqrt(pt ** 2 + pz ** 2)
    vx, vy, vz = c["vx"][tr], c["vy"][tr], c["vz"][tr]
    out = {"EFlowTrack": ({
        "PID": c["pdg"][tr], "Charge": c["q"][tr], "P": p, "PT": pt, "Eta": c["eta"][tr], "Phi": c["phi"][tr],
        "CtgTheta": pz / pt, "Mass": np.sqrt(np.clip(c["e"][tr] ** 2 - p ** 2, 0, None)),
        "T": c["vt"][tr] / C_LIGHT_MM_PER_S, "X": vx, "Y": vy, "Z": vz, "D0": (vx * py - vy * px) / pt,
        "DZ": vz - (vx * px + vy * py) / pt * (pz / pt),
    }, tr)}
    for name, k, em in (("EFlowPhoton", KIND_PHOTON, True), ("EFlowNeutralHadron", KIND_NEUTRAL, False)):
        m = c["kind"] == k
        z = np.zeros(int(m.sum()))
        e = c["e"][m]
        out[name] = ({
            "ET": c["et"][m], "Eta": c["eta"][m], "Phi": c["phi"][m], "E": e, "T": c["vt"][m] / C_LIGHT_MM_PER_S,
            "NTimeHits": z.astype(np.int32), "Eem": e if em else z, "Ehad": z if em else e, "Etrk": z,
        }, m)
    return out


def _leptons(c: dict, cfg: DetectorConfig, rng: np.random.Generator, pid: int, eff: float):
    """(fields, event of each lepton) of the electrons (pid 11) or muons (13), with Delphes isolation."""
    lep_base = (c["kind"] == KIND_TRACK) & (c["pt"] > cfg.lepton_pt_min) & (np.abs(c["eta"]) < cfg.lepton_eta_max)
    cand = np.flatnonzero(lep_base & (np.abs(c["pdg"]) == pid))
    cand = cand[rng.random(len(cand)) < eff]
    lev = c["evt"][cand]
    seg, pos = _segment_index(c["n"][lev])            # every (lepton, candidate of its event) pair
    other = c["start"][lev][seg] + pos
    eta, phi = c["eta"], c["phi"]
    dr2 = (eta[other] - eta[cand][seg]) ** 2 + _delta_phi(phi[other], phi[cand][seg]) ** 2
    inside = (dr2 < cfg.isolation_cone ** 2) & (other != cand[seg])
    is_trk = c["kind"][other] == KIND_TRACK
    sum_ch = np.bincount(seg[inside & is_trk], weights=c["pt"][other][inside & is_trk], minlength=len(cand))
    sum_ne = np.bincount(seg[inside & ~is_trk], weights=c["et"][other][inside & ~is_trk], minlength=len(cand))
    lpt, px, py, pz = c["pt"][cand], c["px"][cand], c["py"][cand], c["pz"][cand]
    vx, vy, vz = c["vx"][cand], c["vy"][cand], c["vz"][cand]
    iso = (sum_ch + sum_ne) / lpt
    zero = np.zeros(len(cand))
    fields = {"PT": lpt, "Eta": eta[cand], "Phi": phi[cand], "T": c["vt"][cand] / C_LIGHT_MM_PER_S,
              "Charge": c["q"][cand]}
    if pid == 11:
        fields["EhadOverEem"] = zero
    fields.update({"IsolationVar": iso, "IsolationVarRhoCorr": iso, "SumPtCharged": sum_ch,
                   "SumPtNeutral": sum_ne, "SumPtChargedPU": zero, "SumPt": sum_ch + sum_ne,
                   "D0": (vx * py - vy * px) / lpt, "DZ": vz - (vx * px + vy * py) / lpt * (pz / lpt),
                   "ErrorD0": zero, "ErrorDZ": zero})
    return fields, lev


def _missing_et(c: dict, n_ev: int) -> dict:
    """Minus the vector sum of all EFlow candidates of each event."""
    s = [np.bincount(c["evt"], weights=c[k], minlength=n_ev) for k in ("px", "py", "pz")]
    met, meta, mphi = _pt_eta_phi(-s[0], -s[1], -s[2])
    return {"MET": met, "Eta": meta, "Phi": mphi}


def _event_info(info, n_ev: int, first_event_number: int, process_id: int) -> dict:
    import awkward as ak

    w = ak.to_numpy(ak.firsts(info.weights)) if "weights" in info.fields else np.ones(n_ev)
    return {
        "Number": first_event_number + np.arange(n_ev, dtype=np.int64),
        "ProcessID": np.full(n_ev, process_id, dtype=np.int32),
        "Weight": np.nan_to_num(np.asarray(w, dtype=np.float64), nan=1.0),
        "Scale": np.sqrt(np.clip(ak.to_numpy(info.pT2Hat), 0, None)),
        "AlphaQED": ak.to_numpy(info.alphaEM), "AlphaQCD": ak.to_numpy(info.alphaS),
        "ID1": ak.to_numpy(info.id1), "ID2": ak.to_numpy(info.id2),
        "X1": ak.to_numpy(info.x1), "X2": ak.to_numpy(info.x2),
    }


def _jets(cfg, rng, n_ev, n_cand, cand_start, px, py, pz, e, kind, q, pdg, from_b, from_c):
    import awkward as ak
    import fastjet

    vectors = ak.unflatten(ak.zip({"px": px, "py": py, "pz": pz, "E": e}), n_cand)
    global _FASTJET_BANNER_SHOWN
    jetdef = fastjet.JetDefinition(fastjet.antikt_algorithm, cfg.jet_radius)
    if not _FASTJET_BANNER_SHOWN:          # fastjet prints a banner to stdout on first use
        with quiet_stdout():
            cs = fastjet.ClusterSequence(vectors, jetdef)
            cs.inclusive_jets(min_pt=cfg.jet_pt_min)
        _FASTJET_BANNER_SHOWN = True
    else:
        cs = fastjet.ClusterSequence(vectors, jetdef)
    jets = cs.inclusive_jets(min_pt=cfg.jet_pt_min)
    const = cs.constituent_index(min_pt=cfg.jet_pt_min)
    n_jets = ak.to_numpy(ak.num(jets, axis=1)).astype(np.int64)
    jpx, jpy, jpz, je = (np.asarray(ak.to_numpy(ak.flatten(jets[c])), dtype=np.float64)
                         for c in ("px", "py", "pz", "E"))
    jet_evt = np.repeat(np.arange(n_ev), n_jets)
    # constituents -> global candidate index; one jet id per constituent
    n_const = ak.to_numpy(ak.flatten(ak.num(const, axis=2))).astype(np.int64)
    local = _flat(const).astype(np.int64)
    jet_of = np.repeat(np.arange(len(jpx)), n_const)
    gidx = local + cand_start[jet_evt][jet_of]
    nj = len(jpx)

    def jsum(w):
        return np.bincount(jet_of, weights=w, minlength=nj)

    has_b = jsum(from_b[gidx].astype(float)) > 0
    has_c = jsum(from_c[gidx].astype(float)) > 0
    flavor = np.where(has_b, 5, np.where(has_c, 4, 0)).astype(np.uint32)
    is_trk = kind[gidx] == KIND_TRACK
    is_em = (kind[gidx] == KIND_PHOTON) | (is_trk & (np.abs(pdg[gidx]) == 11))
    ce = e[gidx]
    e_charged = jsum(np.where(is_trk, ce, 0.0))
    e_em = jsum(np.where(is_em, ce, 0.0))
    e_tot = np.maximum(jsum(ce), 1e-12)
    n_ch = jsum(is_trk.astype(float)).astype(np.int32)
    n_ne = (np.bincount(jet_of, minlength=nj) - n_ch).astype(np.int32)
    jcharge = np.rint(jsum(np.where(is_trk, q[gidx], 0.0))).astype(np.int32)

    jpt, jeta, jphi = _pt_eta_phi(jpx, jpy, jpz)
    jmass = np.sqrt(np.clip(je ** 2 - jpx ** 2 - jpy ** 2 - jpz ** 2, 0, None))
    prob = np.where(flavor == 5, cfg.btag_efficiency,
                    np.where(flavor == 4, cfg.btag_mistag_c, cfg.btag_mistag_light))
    btag = ((rng.random(nj) < prob) & (np.abs(jeta) < cfg.btag_eta_max)).astype(np.uint32)
    order = np.lexsort((-jpt, jet_evt))                    # by event, then pT descending
    zero = np.zeros(nj)
    fields = {
        "PT": jpt, "Eta": jeta, "Phi": jphi, "T": zero, "Mass": jmass, "DeltaEta": zero, "DeltaPhi": zero,
        "Flavor": flavor, "FlavorAlgo": flavor, "FlavorPhys": flavor,
        "BTag": btag, "BTagAlgo": btag, "BTagPhys": btag, "TauTag": np.zeros(nj, np.uint32), "TauWeight": zero,
        "Charge": jcharge, "EhadOverEem": np.where(e_em > 0, (e_tot - e_em) / np.maximum(e_em, 1e-12), 999.9),
        "NCharged": n_ch, "NNeutrals": n_ne,
        "NeutralEnergyFraction": (e_tot - e_charged) / e_tot, "ChargedEnergyFraction": e_charged / e_tot,
    }
    return {k: v[order] for k, v in fields.items()}, n_jets
