"""Delphes-layout ROOT files written with uproot for the ingestion/feature tests.

``write_delphes_like`` writes the REQUIRED_BRANCHES collections of some events (taken from the
real ``delphes.root``) the way ``pipeline.simulate`` does: one jagged record per collection,
branches ``C.F`` and counters ``C_size``. ``boosted`` adds to every event a 40 GeV muon along its
leading track (its own track stays in EFlowTrack, as in Delphes), so that most events pass the
lepton selection and the split/balancing/scaling code sees more than one event.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def read_required(delphes_root) -> dict:
    import awkward as ak
    import uproot

    from pipeline.features.delphes import REQUIRED_BRANCHES

    t = uproot.open(delphes_root)["Delphes"]
    arrs = t.arrays(list(REQUIRED_BRANCHES))
    cols: dict = {}
    for name in REQUIRED_BRANCHES:
        coll, field = name.split(".", 1)
        cols.setdefault(coll, {})[field] = arrs[name]
    return {c: ak.zip(f) for c, f in cols.items()}


def boosted(colls: dict) -> dict:
    """Give every event a 40 GeV muon along its leading track."""
    import awkward as ak

    trk = colls["EFlowTrack"]
    lead = ak.drop_none(trk[ak.argmax(trk.PT, axis=1, keepdims=True)], axis=1)
    mu = ak.zip({"PT": ak.values_astype(lead.PT * 0 + 40.0, np.float32), "Eta": lead.Eta, "Phi": lead.Phi,
                 "Charge": ak.values_astype(lead.Charge * 0 - 1, np.int32)})
    out = dict(colls)
    out["Muon"] = mu
    return out


def take(colls: dict, index) -> dict:
    return {k: v[np.asarray(index)] for k, v in colls.items()}


def write_delphes_like(path, colls: dict, tree: str = "Delphes", empty: bool = False) -> Path:
    import uproot

    path = Path(path)
    with uproot.recreate(str(path)) as f:
        t = f.mktree(tree, {k: v.type.content for k, v in colls.items()},
                     field_name=lambda outer, inner: f"{outer}.{inner}",
                     counter_name=lambda counter: f"{counter}_size")
        if not empty:
            t.extend(colls)
    return path


def write_plain_tree(path, tree: str = "Delphes") -> Path:
    """A tree named like Delphes but without its collections (one flat branch ``x``)."""
    import uproot

    with uproot.recreate(str(path)) as f:
        f.mktree(tree, {"x": "float32"})
        f[tree].extend({"x": np.arange(5, dtype=np.float32)})
    return Path(path)
