"""The read every ingestion task does (``pipeline.ingest.root.read_arrow``): flat numeric branches
through NumPy straight to Arrow, the others through awkward. It must give the columns, Arrow types
and values of the awkward path (``to_arrow(read_arrays(...))``) and of uproot's own arrays, on the
real samples: every NanoAOD dtype (bool, uint8, int32, uint32, uint64, float32, jagged ones), Delphes'
objects and fixed-size arrays (an RNTuple takes the awkward path whole)."""
from __future__ import annotations

import awkward as ak
import numpy as np
import pyarrow as pa
import pytest
import uproot

from pipeline.ingest.root import branches_by_name, open_tree, read_arrays, read_arrow, supported_branches, to_arrow
from pipeline.ingest.root.trees import is_flat


def _same(a: pa.Table, b: pa.Table) -> None:
    assert a.schema.equals(b.schema), [(x, y) for x, y in zip(a.schema, b.schema) if x != y][:3]
    assert a.num_rows == b.num_rows
    for i, name in enumerate(a.column_names):
        x, y = (ak.from_arrow(t.column(i).combine_chunks()) for t in (a, b))
        assert ak.array_equal(x, y, equal_nan=True, dtype_exact=True), name


@pytest.mark.parametrize("name,tree", [("nano_dy.root", "Events"), ("delphes.root", "Delphes")])
def test_read_arrow_equals_the_awkward_path(samples_dir, name, tree):
    t = open_tree(str(samples_dir / name), tree)
    branches, _, _ = supported_branches(t, list(branches_by_name(t)), ["*"])
    stop = min(int(t.num_entries), 30)
    _same(read_arrow(t, branches, 3, stop), to_arrow(read_arrays(t, branches, 3, stop)))
    _same(read_arrow(t, branches, 0, 0), to_arrow(read_arrays(t, branches, 0, 0)))


def test_every_nanoaod_dtype_equals_uproots_arrays(samples_dir):
    """Each flat branch, of every dtype the NanoAOD sample has, equals uproot's NumPy array bit for
    bit with the same (unsigned) type, and the jagged ones equal uproot's awkward arrays."""
    path = str(samples_dir / "nano_dy.root")
    t = open_tree(path, "Events")
    names = list(branches_by_name(t))
    table = read_arrow(t, names, 0, 40)
    plain = uproot.open(path)["Events"]
    flat = [n for n in names if is_flat(plain[n].interpretation)]
    dtypes = {plain[n].interpretation.to_dtype for n in flat}
    assert {np.dtype(x) for x in ("bool", "uint8", "int32", "uint32", "uint64", "float32")} <= dtypes
    ref = plain.arrays(flat, library="np")
    for n in flat:
        col = table.column(n).to_numpy()
        assert col.dtype == ref[n].dtype and np.array_equal(col, ref[n], equal_nan=True), n
        assert table.schema.field(n).type == pa.from_numpy_dtype(ref[n].dtype)
    jagged = [n for n in names if n not in flat]
    assert len(jagged) > 300
    refj = plain.arrays(jagged)
    for n in jagged:
        assert ak.array_equal(ak.from_arrow(table.column(n)), refj[n], equal_nan=True, dtype_exact=True), n
    assert table.schema.field("Muon_charge").type == pa.list_(pa.field("item", pa.int32(), nullable=False))


def _bitwise(a: np.ndarray, b: np.ndarray) -> bool:
    """The same dtype and the same bytes (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_flat_branches_read_from_their_baskets_are_uproots_arrays(samples_dir):
    """Every flat branch of the real NanoAOD file (ZLIB), over whole, inner and empty ranges: read
    straight from the baskets, none left to uproot, and bit for bit uproot's arrays."""
    from pipeline.ingest.root.baskets import read_flat

    t = open_tree(str(samples_dir / "nano_dy.root"), "Events")
    flat = [n for n in t.keys() if is_flat(t[n].interpretation)]
    assert len(flat) == 1120
    for a, b in [(0, 40), (5, 17), (39, 40), (3, 3)]:
        got, rest = read_flat(t, flat, a, b)
        assert rest == [] and list(got) == flat
        ref = t.arrays(flat, entry_start=a, entry_stop=b, library="np")
        assert all(_bitwise(got[n], ref[n]) for n in flat), [n for n in flat if not _bitwise(got[n], ref[n])][:3]


@pytest.mark.parametrize("compression,direct", [("zlib", True), (None, True), ("lz4", False)])
def test_baskets_across_ranges_and_codecs_or_left_to_uproot(tmp_path, compression, direct):
    """Several baskets per branch (one per extend), every flat dtype NanoAOD has, ranges that start
    and end inside baskets: the same bytes as uproot; a basket of a codec other than ZLIB is left
    to uproot, and read_arrow gives uproot's columns either way."""
    from pipeline.ingest.root.baskets import read_flat

    codec = {"zlib": uproot.ZLIB(1), "lz4": uproot.LZ4(1), None: None}[compression]
    rng = np.random.default_rng(7)
    dtypes = {"b": np.bool_, "u8": np.uint8, "i4": np.int32, "u4": np.uint32, "u8b": np.uint64,
              "i8": np.int64, "f4": np.float32, "f8": np.float64}
    path = tmp_path / "flat.root"
    with uproot.recreate(path, compression=codec) as f:
        f.mktree("t", {n: d for n, d in dtypes.items()})
        for n_entries in (100, 37, 250):
            f["t"].extend({n: (rng.integers(0, 2, n_entries).astype(d) if d is np.bool_ else
                               (rng.normal(size=n_entries) * 1e3).astype(d)) for n, d in dtypes.items()})
    t = open_tree(str(path), "t")
    names = list(dtypes)
    assert all(len(t[n].entry_offsets) == 4 for n in names)
    for a, b in [(0, 387), (99, 101), (100, 137), (50, 300), (386, 387)]:
        got, rest = read_flat(t, names, a, b)
        assert sorted([*got, *rest]) == sorted(names)
        assert rest == [] if direct else rest          # an LZ4 basket is uproot's (one too small to compress is not)
        ref = t.arrays(names, entry_start=a, entry_stop=b, library="np")
        assert all(_bitwise(got[n], ref[n]) for n in got)
        _same(read_arrow(t, names, a, b), to_arrow(read_arrays(t, names, a, b)))


def test_a_corrupt_basket_is_left_to_uproot_which_reports_it(tmp_path, samples_dir):
    """A basket whose compressed bytes are damaged is not read here: uproot reads it and raises its
    own error, as it did before this path existed."""
    import shutil

    from pipeline.ingest.root.baskets import read_flat

    path = tmp_path / "damaged.root"
    shutil.copy(samples_dir / "nano_dy.root", path)
    t = open_tree(str(path), "Events")
    b = t["run"]
    seek, size = int(b.member("fBasketSeek")[0]), int(b.member("fBasketBytes")[0])
    with open(path, "r+b") as f:                   # the payload's middle, past the key and block header
        f.seek(seek + size - 8)
        f.write(b"\xff" * 6)
    t = open_tree(str(path), "Events")
    got, rest = read_flat(t, ["run", "luminosityBlock"], 0, 40)
    assert rest == ["run"] and list(got) == ["luminosityBlock"]
    with pytest.raises(Exception):
        read_arrow(t, ["run"], 0, 40)


def test_jagged_branches_read_from_their_baskets_are_the_awkward_paths_lists(samples_dir, tmp_path):
    """Every NanoAOD collection member (379 branches of numbers per entry) read straight from its
    baskets: none left to uproot, and the Arrow lists of the awkward path, type and values; the
    same on a generated file of several baskets, over ranges that cut through them."""
    import awkward as ak

    from pipeline.ingest.root.baskets import is_plain_jagged, read_jagged

    t = open_tree(str(samples_dir / "nano_dy.root"), "Events")
    jagged = [n for n in t.keys() if is_plain_jagged(t[n].interpretation)]
    assert len(jagged) == 379
    path = tmp_path / "jagged.root"
    rng = np.random.default_rng(3)
    with uproot.recreate(path, compression=uproot.ZLIB(1)) as f:
        f.mktree("t", {"nJ": np.int32, "J_pt": "var * float32", "J_id": "var * uint8", "J_ok": "var * bool"},
                 counter_name=lambda counted: "nJ", field_name=lambda outer, inner: f"J_{inner}")
        for n in (60, 25, 90):
            counts = rng.integers(0, 5, n)
            items = int(counts.sum())
            f["t"].extend({"nJ": counts.astype(np.int32),
                           "J_pt": ak.unflatten(rng.normal(size=items).astype(np.float32), counts),
                           "J_id": ak.unflatten(rng.integers(0, 255, items).astype(np.uint8), counts),
                           "J_ok": ak.unflatten(rng.integers(0, 2, items).astype(bool), counts)})
    g = open_tree(str(path), "t")
    cases = [(t, jagged, [(0, 40), (5, 17), (39, 40), (7, 7)]),
             (g, ["J_pt", "J_id", "J_ok"], [(0, 175), (59, 61), (60, 85), (10, 170)])]
    for tree, names, ranges in cases:
        for a, b in ranges:
            got, rest = read_jagged(tree, names, a, b)
            assert rest == [] and list(got) == names
            ref = to_arrow(read_arrays(tree, names, a, b))
            for n in names:
                assert got[n].type == ref.schema.field(n).type, n
                assert ak.array_equal(ak.from_arrow(got[n]), ak.from_arrow(ref.column(n).combine_chunks()),
                                      equal_nan=True, dtype_exact=True), (n, a, b)


def _mixed_file(path, rng) -> list[str]:
    """Flat and jagged branches of several baskets (one per extend)."""
    with uproot.recreate(path, compression=uproot.ZLIB(1)) as f:
        f.mktree("t", {"run": np.uint32, "x": np.float64, "nJ": np.int32, "J_pt": "var * float32",
                       "J_id": "var * uint8"},
                 counter_name=lambda counted: "nJ", field_name=lambda outer, inner: f"J_{inner}")
        for n in (60, 25, 90):
            counts = rng.integers(0, 5, n)
            items = int(counts.sum())
            f["t"].extend({"run": rng.integers(0, 9, n).astype(np.uint32), "x": rng.normal(size=n),
                           "nJ": counts.astype(np.int32),
                           "J_pt": ak.unflatten(rng.normal(size=items).astype(np.float32), counts),
                           "J_id": ak.unflatten(rng.integers(0, 255, items).astype(np.uint8), counts)})
    return ["run", "x", "nJ", "J_pt", "J_id"]


def test_a_basket_map_reads_each_range_without_opening_the_tree(samples_dir, tmp_path, monkeypatch):
    """The basket maps made where a file is planned (plain arrays: seeks, sizes, entries) let a task
    read every flat and jagged branch of its range with no uproot object: the table read_arrow
    gives on the open tree, for the real NanoAOD file and a generated file of several baskets, over
    ranges that cut through baskets; a Delphes file's object branches are read on the tree."""
    from pipeline.ingest.root import trees
    from pipeline.ingest.root.baskets import basket_maps, read_mapped

    gen = tmp_path / "mixed.root"
    names = _mixed_file(gen, np.random.default_rng(5))
    nano = samples_dir / "nano_dy.root"
    t_nano = open_tree(str(nano), "Events")
    cases = [(nano, "Events", list(t_nano.keys()), [(0, 13), (13, 40)]),
             (gen, "t", names, [(0, 59), (59, 61), (61, 175)]),
             (gen, "t", names, [(0, 70), (70, 175)])]        # a range over two baskets of each branch, then one
    for path, tree, branches, ranges in cases:
        t = open_tree(str(path), tree)
        maps = basket_maps(t, branches, ranges)
        refs = [read_arrow(t, branches, a, b) for a, b in ranges]
        for (a, b), m in zip(ranges, maps):
            got, rest = read_mapped(str(path), m, branches, a, b)
            assert rest == [] and sorted(got) == sorted(branches)
        with monkeypatch.context() as mp:             # no tree is opened for these reads
            mp.setattr(trees, "open_tree", lambda *a: pytest.fail("the tree was opened"))
            trees._OPEN.clear()
            for (a, b), m, ref in zip(ranges, maps, refs):
                _same(trees.read_arrow_mapped(str(path), tree, branches, a, b, m), ref)
    delphes = samples_dir / "delphes.root"
    t = open_tree(str(delphes), "Delphes")
    branches, _, _ = supported_branches(t, list(branches_by_name(t)), ["*"])
    (m,) = basket_maps(t, branches, [(2, 19)])
    got, rest = read_mapped(str(delphes), m, branches, 2, 19)
    assert got and rest and set(got) | set(rest) == set(branches)
    _same(trees.read_arrow_mapped(str(delphes), "Delphes", branches, 2, 19, m, scope="test"),
          read_arrow(t, branches, 2, 19))


def test_a_basket_map_of_another_file_or_range_is_not_used(tmp_path):
    """A map is used only for the file it was made from: a file rewritten in place after planning
    (other baskets, another modification time) is read on its own tree, as is a range the map's
    baskets do not hold; no number is read from the wrong bytes."""
    import os

    from pipeline.ingest.root import trees
    from pipeline.ingest.root.baskets import basket_maps, read_mapped

    path = tmp_path / "mixed.root"
    names = _mixed_file(path, np.random.default_rng(5))
    first, second = basket_maps(open_tree(str(path), "t"), names, [(0, 60), (60, 175)])
    for a, b in [(60, 175), (30, 100)]:                              # another range's baskets, or part of them
        got, rest = read_mapped(str(path), first, names, a, b)
        assert got == {} and rest == names, (a, b)
    got, rest = read_mapped(str(path), first, names, 10, 50)         # inside its own range
    assert rest == []
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    got, rest = read_mapped(str(path), first, names, 10, 50)         # the same bytes, touched: not trusted
    assert got == {} and rest == names
    _mixed_file(path, np.random.default_rng(6))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    got, rest = read_mapped(str(path), second, names, 60, 175)
    assert got == {} and rest == names
    t = open_tree(str(path), "t")
    trees._OPEN.clear()
    _same(trees.read_arrow_mapped(str(path), "t", names, 60, 175, second), read_arrow(t, names, 60, 175))


def test_a_branch_that_cannot_be_mapped_leaves_the_file_unmapped(tmp_path, monkeypatch):
    """The maps only save time: a branch whose baskets cannot be listed (any error but the time
    limit) gives no map for the file's chunks, which then read through the tree, instead of failing
    the plan (and with it the file)."""
    from pipeline.ingest.root import baskets
    from pipeline.ingest.root.deadline import ReadTimeout

    path = tmp_path / "mixed.root"
    names = _mixed_file(path, np.random.default_rng(5))
    t = open_tree(str(path), "t")
    real = baskets._basket_rows

    def broken(branch):
        if branch.name == "x":
            raise ValueError("unreadable fBasketSeek")
        return real(branch)

    monkeypatch.setattr(baskets, "_basket_rows", broken)
    assert baskets.basket_maps(t, names, [(0, 60), (60, 175)]) == [None, None]

    def late(branch):
        raise ReadTimeout("read timed out after 1 s")

    monkeypatch.setattr(baskets, "_basket_rows", late)
    with pytest.raises(ReadTimeout):                   # the file's time limit still ends the plan
        baskets.basket_maps(t, names, [(0, 60), (60, 175)])
