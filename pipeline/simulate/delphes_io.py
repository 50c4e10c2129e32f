"""Write :class:`~pipeline.simulate.detector.Collections` as a Delphes-layout ROOT file (uproot).

Layout: one TTree ``Delphes``; each collection ``C`` is a jagged record written with
``field_name=C.F`` and ``counter_name=C_size``, so the branches are ``Electron.PT``,
``Electron.Eta``, ..., and the counter ``Electron_size`` -- the names and the C types
(float / int32 / uint32 / int64) of a real Delphes 3 file, readable the same way:
``tree["Electron.PT"]``, ``tree.arrays(["Jet.PT", "Jet.BTag"])``, ``tree.arrays(filter_name="Jet.*")``.
(A real file's top-level ``Electron`` branch (the TClonesArray) does not exist here: read the
leaves or ``Electron_size``.)

Note: plain ``file["Delphes"] = {...}`` in uproot >= 5.6 writes an RNTuple, and ``mktree`` without
``field_name`` writes ``Electron_PT`` / ``nElectron``; neither is what Delphes readers expect.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

F, I, U, L = np.float32, np.int32, np.uint32, np.int64

#: collection -> {branch field: numpy dtype}, in Delphes' branch order (a subset of real Delphes 3).
SCHEMA: dict[str, dict[str, type]] = {
    "Event": {"Number": L, "ProcessID": I, "Weight": F, "Scale": F, "AlphaQED": F, "AlphaQCD": F,
              "ID1": I, "ID2": I, "X1": F, "X2": F},
    "Electron": {"PT": F, "Eta": F, "Phi": F, "T": F, "Charge": I, "EhadOverEem": F, "IsolationVar": F,
                 "IsolationVarRhoCorr": F, "SumPtCharged": F, "SumPtNeutral": F, "SumPtChargedPU": F,
                 "SumPt": F, "D0": F, "DZ": F, "ErrorD0": F, "ErrorDZ": F},
    "Muon": {"PT": F, "Eta": F, "Phi": F, "T": F, "Charge": I, "IsolationVar": F, "IsolationVarRhoCorr": F,
             "SumPtCharged": F, "SumPtNeutral": F, "SumPtChargedPU": F, "SumPt": F, "D0": F, "DZ": F,
             "ErrorD0": F, "ErrorDZ": F},
    "Jet": {"PT": F, "Eta": F, "Phi": F, "T": F, "Mass": F, "DeltaEta": F, "DeltaPhi": F, "Flavor": U,
            "FlavorAlgo": U, "FlavorPhys": U, "BTag": U, "BTagAlgo": U, "BTagPhys": U, "TauTag": U,
            "TauWeight": F, "Charge": I, "EhadOverEem": F, "NCharged": I, "NNeutrals": I,
            "NeutralEnergyFraction": F, "ChargedEnergyFraction": F},
    "MissingET": {"MET": F, "Eta": F, "Phi": F},
    "EFlowTrack": {"PID": I, "Charge": I, "P": F, "PT": F, "Eta": F, "Phi": F, "CtgTheta": F, "Mass": F,
                   "T": F, "X": F, "Y": F, "Z": F, "D0": F, "DZ": F},
    "EFlowPhoton": {"ET": F, "Eta": F, "Phi": F, "E": F, "T": F, "NTimeHits": I, "Eem": F, "Ehad": F, "Etrk": F},
    "EFlowNeutralHadron": {"ET": F, "Eta": F, "Phi": F, "E": F, "T": F, "NTimeHits": I, "Eem": F, "Ehad": F,
                           "Etrk": F},
}
TREE = "Delphes"


def branch_names() -> list[str]:
    """Every leaf branch name written, e.g. ``Electron.PT``."""
    return [f"{c}.{f}" for c, fields in SCHEMA.items() for f in fields]


def to_awkward(cols: dict, counts: dict) -> dict:
    """Collections -> {name: ``n * var * record``} with the schema's exact dtypes."""
    import awkward as ak

    out = {}
    for name, fields in SCHEMA.items():
        rec = ak.zip({f: np.asarray(cols[name][f]).astype(dt, copy=False) for f, dt in fields.items()},
                     depth_limit=1)
        out[name] = ak.unflatten(rec, np.asarray(counts[name], dtype=np.int64))
    return out


def write_delphes(path: str | Path, batches, *, compression: str = "zlib4") -> int:
    """Write an iterable of Collections into one ROOT file (one ``extend`` per batch); returns events.

    The file is written under ``path`` directly: callers write into an atomic output directory.
    """
    import uproot

    algo, level = compression[:-1], int(compression[-1])
    comp = {"zlib": uproot.ZLIB, "lz4": uproot.LZ4, "zstd": uproot.ZSTD, "lzma": uproot.LZMA}[algo](level)
    n = 0
    with uproot.recreate(str(path), compression=comp) as f:
        tree = None
        for b in batches:
            arrays = to_awkward(b.cols, b.counts)
            if tree is None:
                tree = f.mktree(TREE, {k: v.type.content for k, v in arrays.items()},
                                field_name=lambda outer, inner: f"{outer}.{inner}",
                                counter_name=lambda counter: f"{counter}_size")
            tree.extend(arrays)
            n += b.n_events
        if tree is None:
            raise ValueError(f"{path}: no events to write")
    return n
