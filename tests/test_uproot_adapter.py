"""The one place that reaches into uproot's internals (pipeline/ingest/uproot_adapter.py): these
tests fail when uproot changes what the adapter relies on (a TTree's ``_lookup`` dictionary, and
``__getitem__`` consulting it before its recursive search), and check that the index changes no
result, on the real Delphes sample."""
from __future__ import annotations

import awkward as ak
import numpy as np
import pytest
import uproot

from pipeline.ingest.uproot_adapter import (index_nested_branches, index_rntuple_fields, interpretation_key,
                                           memoize_classnames, reuse_interpretations, use_fast_zlib)


@pytest.fixture
def tree(delphes_root):
    with uproot.open(delphes_root) as f:
        yield f["Delphes"]


def test_the_internal_exists_and_the_index_extends_it(tree):
    assert isinstance(getattr(tree, "_lookup", None), dict)        # the internal the adapter extends
    assert "Electron.PT" not in tree._lookup                      # uproot keeps direct sub-branches only
    assert index_nested_branches(tree) is True
    nested = {n for n, _ in tree.iteritems(recursive=True, full_paths=False)}
    assert {"Electron.PT", "Jet.PT", "Jet.FracPt[5]"} <= nested <= set(tree._lookup)


def test_getitem_finds_indexed_names_without_the_recursive_search(tree, monkeypatch):
    """uproot's ``__getitem__`` must take an indexed name from ``_lookup``: with its recursive search
    disabled, the nested names still resolve, to the same branch objects as before."""
    import uproot.behaviors.TBranch as TB

    before = {n: tree[n] for n in ("Electron.PT", "Jet.Eta", "MissingET.MET")}
    index_nested_branches(tree)

    def no_walk(*args, **kwargs):
        raise AssertionError("uproot walked the branch tree for an indexed name")

    monkeypatch.setattr(TB, "_get_recursive", no_walk)
    assert {n: tree[n] for n in before} == before


def test_the_index_reads_the_same_arrays(delphes_root, tree):
    names = [n for n, b in tree.iteritems(recursive=True, full_paths=False) if not len(b.branches)][:200]
    index_nested_branches(tree)
    with uproot.open(delphes_root) as f:
        plain = f["Delphes"].arrays(names, entry_stop=5, library="ak")
    indexed = tree.arrays(names, entry_stop=5, library="ak")
    assert indexed.fields == plain.fields == names
    assert all(ak.array_equal(indexed[n], plain[n], equal_nan=True) for n in names)


def test_a_tree_without_the_internal_is_left_alone():
    class Other:
        pass

    assert index_nested_branches(Other()) is False


# ------------------------------------------------------------------ an RNTuple's subfield index
@pytest.fixture
def nano_rntuple(samples_dir):
    return samples_dir / "nano_dy_rntuple.root"


def _subfields(ntuple) -> list[list[int]]:
    return [[g._fid for g in f.fields] for f in ntuple.ntuple.all_fields]


def test_the_rntuple_index_gives_uproots_own_subfields(nano_rntuple):
    """Every field's subfields (ids, order, anonymous fields replaced by their own) are those uproot
    computes itself, and the RNTuple's keys and arrays are the same."""
    with uproot.open(nano_rntuple) as f, uproot.open(nano_rntuple) as g:
        indexed, plain = f["Events"], g["Events"]
        assert all(x._fields is None for x in indexed.ntuple.all_fields)   # the internal the index fills
        assert index_rntuple_fields(indexed) is True
        assert all(x._fields is not None for x in indexed.ntuple.all_fields)
        assert any(x.is_anonymous for x in plain.ntuple.all_fields)       # the sample has the case
        assert _subfields(indexed) == _subfields(plain)
        assert indexed.keys() == plain.keys() and len(plain.keys()) > 1000
        names = ["Muon_pt", "Jet_eta", "nMuon", "event"]
        a, b = indexed.arrays(names, entry_stop=10), plain.arrays(names, entry_stop=10)
        assert a.fields == b.fields and all(ak.array_equal(a[n], b[n]) for n in names)


def test_uproot_returns_the_index_instead_of_scanning_the_records(nano_rntuple):
    """uproot's ``fields`` must hand back a filled ``_fields`` as it is (its scan of the records runs
    only while the slot is empty)."""
    with uproot.open(nano_rntuple) as f:
        t = f["Events"]
        index_rntuple_fields(t)
        assert all(x.fields is x._fields for x in t.ntuple.all_fields)


def test_an_rntuple_without_the_internal_is_left_alone():
    class Other:
        pass

    assert index_rntuple_fields(Other()) is False


# ------------------------------------------------------------------ interpretations reused across files
@pytest.fixture
def nano_dy(samples_dir):
    return samples_dir / "nano_dy.root"


def test_uproot_reads_with_the_interpretation_in_the_slot(nano_dy):
    """uproot's ``interpretation`` must return a filled ``_interpretation`` as it is (it identifies
    only while the slot is empty), and ``arrays`` must read with it."""
    from uproot.interpretation.numerical import AsDtype

    with uproot.open(nano_dy) as f:
        t = f["Events"]
        b = t["run"]
        assert b._interpretation is None                            # the internal reuse_interpretations fills
        b._interpretation = AsDtype(">i4")                          # run is uint32 in the file
        assert b.interpretation is b._interpretation
        assert t.arrays(["run"], entry_stop=3, library="np")["run"].dtype == np.dtype("int32")


def test_reused_interpretations_are_uproots_own_across_nanoaod_versions(samples_dir):
    """A second file's plain branches get the plans of the first (NanoAOD v9-like nano_dy, then
    nano_tt_v15, where same-named branches changed type): each equal to uproot's own identification
    of that file, and the arrays read with them equal to a plain uproot read."""
    plans: dict = {}
    for name in ("nano_dy.root", "nano_tt_v15.root"):
        with uproot.open(samples_dir / name) as f, uproot.open(samples_dir / name) as g:
            t, plain = f["Events"], g["Events"]
            names = [n for n in t.keys() if interpretation_key(t[n]) is not None]
            assert len(names) > 1000
            before = len(plans)
            reused = reuse_interpretations(t, names, plans)
            assert reused + len(plans) - before == len(names)
            assert all(t[n].interpretation == plain[n].interpretation for n in names)
            assert all(t[n].interpretation.cache_key == plain[n].interpretation.cache_key for n in names)
            cols = names[::7]
            a, b = t.arrays(cols, entry_stop=20), plain.arrays(cols, entry_stop=20)
            assert all(ak.array_equal(a[n], b[n], equal_nan=True, dtype_exact=True) for n in cols)
    assert reused > 500                   # the second file took most of its plans from the first


def test_the_key_separates_leaves_uproot_interprets_differently(samples_dir):
    with uproot.open(samples_dir / "nano_dy.root") as f:
        t = f["Events"]
        keys = {}
        for n in t.keys():
            k = interpretation_key(t[n])
            if k is not None:
                keys.setdefault(k, set()).add(repr(t[n].interpretation))
        assert all(len(v) == 1 for v in keys.values())             # one interpretation per key
        assert len({r for v in keys.values() for r in v}) >= 8      # bool, (u)int8-64, float, jagged ones


def test_a_branch_element_has_no_key(tree):
    assert interpretation_key(tree["Jet.PT"]) is None              # TBranchElement: uproot identifies it


# ------------------------------------------------------------------ ISA-L decompression
def test_fast_zlib_is_the_switch_uproot_reads_with(nano_dy):
    """uproot decompresses baskets through ``_DecompressZLIB.library``: an unknown name there
    fails the read (so the switch is the one in use), ISA-L reads the same arrays as zlib."""
    from uproot import compression

    cls = compression._DecompressZLIB
    saved = cls.library
    try:
        cls.library = "zlib"
        with uproot.open(nano_dy) as f:
            ref = f["Events"].arrays(["Muon_pt", "event", "HLT_IsoMu24"])
        cls.library = "no-such-library"
        with uproot.open(nano_dy) as f, pytest.raises(ValueError, match="unrecognized ZLIB.library"):
            f["Events"].arrays(["Muon_pt"])
        cls.library = saved
        assert use_fast_zlib() == "isal" and cls.library == "isal"   # isal is pinned in requirements*.txt
        with uproot.open(nano_dy) as f:
            got = f["Events"].arrays(["Muon_pt", "event", "HLT_IsoMu24"])
        assert all(ak.array_equal(got[n], ref[n], equal_nan=True, dtype_exact=True) for n in ref.fields)
    finally:
        cls.library = saved


# ------------------------------------------------------------------ class names regularised once
def test_memoized_classnames_are_the_ones_uproot_uses(nano_dy):
    """uproot looks ``classname_regularize`` up on its module at each call (the cache is hit while
    a TTree's metadata are read), and the cached function gives uproot's own answers."""
    from uproot import model

    saved = model.classname_regularize
    plain = getattr(saved, "__wrapped__", saved)
    try:
        model.classname_regularize = plain
        assert memoize_classnames() is True
        cached = model.classname_regularize
        with uproot.open(nano_dy) as f:
            f["Events"]
            names = list(f.file.streamers)                             # the class names of the file
        assert cached.cache_info().hits > 1000
        for n in names + ["std :: vector < int >", "ROOT::VecOps::RVec<Float_t>", "TBranch"]:
            assert cached(n) == plain(n)
    finally:
        model.classname_regularize = saved


def test_fast_zlib_leaves_writing_alone():
    """Files uproot writes in the same process stay zlib level-1 compressed (ISA-L's level 1 would
    be its level 0: larger files)."""
    import zlib

    from uproot import compression

    data = np.arange(50_000, dtype=">f4").tobytes()
    saved = (compression._DecompressZLIB.library, vars(compression.ZLIB).get("library"))
    try:
        use_fast_zlib()
        assert uproot.ZLIB(1).compress(data) == zlib.compress(data, 1)
    finally:
        compression._DecompressZLIB.library = saved[0]
        if saved[1] is None and "library" in vars(compression.ZLIB):
            delattr(compression.ZLIB, "library")
        elif saved[1] is not None:
            compression.ZLIB.library = saved[1]
