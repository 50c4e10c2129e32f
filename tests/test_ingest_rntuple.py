"""RNTuple input: ingest_root and the feature stage read RNTuples as they read TTrees (the coffea
NanoAOD RNTuple samples and Delphes-layout RNTuples written with uproot)."""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hep_root_fixtures as H  # noqa: E402

from pipeline.errors import BadInputError  # noqa: E402
from pipeline.ingest.root import IngestRootConfig, ingest_root, plan_chunks, read_chunk  # noqa: E402

NANO = ["Muon_*", "nMuon", "run", "event", "HLT_IsoMu24"]


def _parts(path) -> pa.Table:
    files = sorted(p for p in os.listdir(path) if p.endswith(".parquet"))
    return pa.concat_tables([pq.read_table(os.path.join(path, f)) for f in files])


def test_rntuple_and_ttree_give_the_same_parquet(spark, samples_dir, tmp_path):
    import uproot

    out = {}
    for kind, name in (("ttree", "nano_dy.root"), ("rntuple", "nano_dy_rntuple.root")):
        rep = ingest_root(IngestRootConfig(input=str(samples_dir / name), tree="Events", filter_name=NANO,
                                           output=str(tmp_path / kind), step_size=15), spark=spark)
        assert rep["rows"] == 40 and not rep["bad_files"]
        out[kind] = _parts(tmp_path / kind)
    rn = uproot.open(samples_dir / "nano_dy_rntuple.root")["Events"]
    table = out["rntuple"]
    assert table.num_rows == rn.num_entries == 40
    for col in ("Muon_pt", "Muon_charge", "Muon_tightId", "event"):
        assert table.column(col).to_pylist() == rn[col].array(library="ak").tolist()
    assert table.schema.field("nMuon").type == pa.uint32()          # the cardinality's declared type
    # same columns, types and values; the column order is each file's own field order
    assert sorted(table.column_names) == sorted(out["ttree"].column_names)
    assert table.select(out["ttree"].column_names).equals(out["ttree"])


def test_rntuple_chunks_follow_its_clusters(tmp_path):
    import awkward as ak
    import uproot

    path = tmp_path / "clusters.root"
    with uproot.recreate(path) as f:
        def data(n, o):
            return {"x": np.arange(o, o + n, dtype=np.float32), "v": ak.Array([[float(i)] * (i % 3)
                                                                              for i in range(o, o + n)])}
        w = f.mkrntuple("T", data(10, 0))
        w.extend(data(10, 10))
        w.extend(data(5, 20))
    plan = plan_chunks([str(path)], "T", ["*"], step_size=10, progress=False)
    assert [(c.entry_start, c.entry_stop) for c in plan.chunks] == [(0, 10), (10, 20), (20, 25)]
    assert read_chunk(str(path), "T", ["v"], 8, 12)["v"].tolist() == [[8.0, 8.0], [], [10.0], [11.0, 11.0]]
    assert [(c.entry_start, c.entry_stop) for c in
            plan_chunks([str(path)], "T", ["*"], step_size="1 MB", progress=False).chunks] == [(0, 25)]


def test_corrupt_and_empty_rntuples(spark, samples_dir, tmp_path):
    good = samples_dir / "nano_dy_rntuple.root"
    bad = tmp_path / "truncated_rntuple.root"
    data = good.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    empty = tmp_path / "nano_dy_empty_rntuple.root"
    shutil.copy(samples_dir / "nano_dy_empty_rntuple.root", empty)
    out = tmp_path / "out"
    with pytest.raises(BadInputError) as ei:
        ingest_root(IngestRootConfig(input=[str(good), str(bad), str(empty)], tree="Events", filter_name=NANO,
                                     output=str(out)), spark=spark)
    assert "\n" not in str(ei.value) and "1 of 3 input file(s) failed" in str(ei.value)
    assert str(bad) in str(ei.value)
    rep = json.loads((out / "_report.json").read_text())
    files = {os.path.basename(f["file"]): f for f in rep["files"]}
    assert files["truncated_rntuple.root"]["error"] and files["truncated_rntuple.root"]["parts"] == []
    assert files["nano_dy_rntuple.root"]["rows"] == 40 and files["nano_dy_rntuple.root"]["error"] is None
    assert files["nano_dy_empty_rntuple.root"]["rows"] == 0 and files["nano_dy_empty_rntuple.root"]["error"] is None
    assert _parts(out).num_rows == 40


def test_rntuple_field_errors_name_the_field(samples_dir):
    plan = plan_chunks([str(samples_dir / "nano_dy_rntuple.root")], "Events", ["Muon_pt", "NoSuchField"],
                       progress=False)
    assert plan.files[0].error == "missing branch 'NoSuchField' in tree 'Events'"
    # an RNTuple's _collectionN storage field is skipped by a pattern, converted when named exactly
    plan = plan_chunks([str(samples_dir / "nano_dy_rntuple.root")], "Events", ["*"], progress=False)
    assert not any(b.startswith("_collection") for b in plan.branches) and "Muon_pt" in plan.branches
    plan = plan_chunks([str(samples_dir / "nano_dy_rntuple.root")], "Events", ["_collection15"], progress=False)
    assert plan.branches == ["_collection15"] and pa.types.is_list(plan.schema.field("_collection15").type)


def test_feature_function_on_a_delphes_layout_rntuple(delphes_root, tmp_path):
    """A Delphes-layout RNTuple (fields named like the TTree's branches) gives the same features."""
    import uproot

    from pipeline.features.delphes import REQUIRED_BRANCHES, compute_features

    colls = H.boosted(H.read_required(delphes_root))
    ttree = H.write_delphes_like(tmp_path / "delphes_tree.root", colls)
    arrays = uproot.open(ttree)["Delphes"].arrays(list(REQUIRED_BRANCHES))
    rpath = tmp_path / "delphes_rntuple.root"
    with uproot.recreate(rpath) as f:
        f.mkrntuple("Delphes", {b: arrays[b] for b in REQUIRED_BRANCHES})
    plan = plan_chunks([str(rpath)], "Delphes", list(REQUIRED_BRANCHES), step_size=10, progress=False)
    assert not plan.bad and sum(c.entry_stop - c.entry_start for c in plan.chunks) == 25
    ev = read_chunk(str(rpath), "Delphes", list(REQUIRED_BRANCHES), 0, 25)
    a, b = compute_features(ev), compute_features(arrays)
    assert len(a.index) >= 5 and a.index.tolist() == b.index.tolist()
    np.testing.assert_array_equal(a.hlf, b.hlf)
    np.testing.assert_array_equal(a.llf, b.llf)
