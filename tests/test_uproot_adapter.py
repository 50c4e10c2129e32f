"""The one place that reaches into uproot's internals (pipeline/ingest/uproot_adapter.py): these
tests fail when uproot changes what the adapter relies on (a TTree's ``_lookup`` dictionary, and
``__getitem__`` consulting it before its recursive search), and check that the index changes no
result, on the real Delphes sample."""
from __future__ import annotations

import awkward as ak
import pytest
import uproot

from pipeline.ingest.uproot_adapter import index_nested_branches, index_rntuple_fields


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
