"""The one module that reaches into uproot's internals (a TTree's ``_lookup``, an RField's ``_fields``).

uproot finds a branch named without its parent's path (``Electron.PT``, not
``Electron/Electron.PT``) by walking the whole branch tree, and ``t.arrays(names)`` does that once
per name: on Delphes' 1105 branches that walk was most of a file's conversion time (quadratic in
the number of branches). ``HasBranches.__getitem__`` first looks the name up in the tree's
``_lookup`` dictionary (its direct sub-branches by name); :func:`index_nested_branches` adds every
nested branch name that occurs once in the tree, so the same branches are found at once. uproot's
public ``filter_name`` selection does not help here: it is slower still on the same file.

An RNTuple's field finds its direct subfields by scanning every field record of the RNTuple, once
per field (``HasFields.fields``, cached in ``_fields``): quadratic in the number of fields, 2.7 s of
every open of the CMS NanoAOD RNTuple sample (2,307 fields) before its first ``keys()`` or
``arrays()``. :func:`index_rntuple_fields` fills every field's ``_fields`` from one pass over the
records, with uproot's own rule (a subfield whose parent is the field; an anonymous one replaced by
its own subfields).

A plain ``TBranch`` (one ``TLeafO/B/S/I/L/F/D/G`` leaf, no sub-branches: the 1,499 branches of a
CMS NanoAOD file) gets its interpretation from uproot's ``identify`` on every open of every file,
about a fifth of reading a small NanoAOD file's data. :func:`reuse_interpretations` keys a branch by
everything that rule reads for such a branch (leaf class, leaf title, ``fLen``, ``fIsUnsigned``,
the counter branch's name) and sets the interpretation found for the same key before (the
branch's ``_interpretation`` slot); any other branch keeps uproot's own identification.
:func:`use_fast_zlib` switches uproot's ZLIB decompression to ISA-L (``isal``, 2.2x zlib's rate on
the same baskets) when it is installed: the same bytes out. Deserialising a TTree's ~4,500 branch and leaf objects calls
``uproot.model.classname_regularize`` (two regular expressions over a class name) some 10,000
times per NanoAOD file on a handful of distinct names: :func:`memoize_classnames` caches that pure
function.

``tests/test_uproot_adapter.py`` fails when uproot changes these internals (no ``_lookup``
dictionary, or ``__getitem__`` no longer consulting it; no ``_fields`` slot, or subfields other than
the index's); the reading itself stays correct then, only slower, since the functions do nothing
without them.
"""
from __future__ import annotations


def index_nested_branches(tree) -> bool:
    """Extend the lookup table of the uproot TTree ``tree`` with every nested branch name that
    occurs once in it (a name that occurs twice keeps uproot's own search). False when this uproot
    has no such table (nothing is changed)."""
    lookup = getattr(tree, "_lookup", None)
    if not isinstance(lookup, dict):
        return False
    pairs = list(tree.iteritems(recursive=True, full_paths=False))
    counts: dict[str, int] = {}
    for name, _ in pairs:
        counts[name] = counts.get(name, 0) + 1
    for name, branch in pairs:
        if counts[name] == 1:
            lookup.setdefault(name, branch)
    return True


def index_rntuple_fields(ntuple) -> bool:
    """Fill the subfield list (``_fields``) of every field of the uproot RNTuple ``ntuple`` that has
    none yet, from one pass over its field records. False when this uproot keeps no such list
    (nothing is changed)."""
    model = getattr(ntuple, "ntuple", None)
    records = getattr(model, "field_records", None)
    fields = getattr(model, "all_fields", None)
    if records is None or fields is None or not all(hasattr(f, "_fields") for f in fields):
        return False
    children: list[list[int]] = [[] for _ in records]
    for i, rec in enumerate(records):
        if rec.parent_field_id != i:            # a top-level field is its own parent
            children[rec.parent_field_id].append(i)
    direct: dict[int, list] = {}

    def subfields(fid: int) -> list:
        if fid not in direct:
            out: list = []
            for i in children[fid]:
                out.extend(subfields(i) if fields[i].is_anonymous else [fields[i]])
            direct[fid] = out
        return direct[fid]

    for fid, field in enumerate(fields):
        if field._fields is None:
            field._fields = subfields(fid)
    return True


#: leaf classes whose interpretation uproot derives from the leaf alone (no streamer, no title range)
_PLAIN_LEAVES = frozenset({"TLeafO", "TLeafB", "TLeafS", "TLeafI", "TLeafL", "TLeafF", "TLeafD", "TLeafG"})


def interpretation_key(branch):
    """What uproot's interpretation of a plain ``TBranch`` depends on, as a hashable key; None for
    any other branch (or when custom interpretations are registered with uproot)."""
    try:
        from uproot.interpretation.identify import _registered_interpretations
    except ImportError:
        return None
    if _registered_interpretations or getattr(branch, "classname", None) != "TBranch" or len(branch.branches):
        return None
    leaves = branch.member("fLeaves")
    if len(leaves) != 1 or leaves[0].classname not in _PLAIN_LEAVES:
        return None
    leaf = leaves[0]
    count = branch.count_branch.name if leaf.member("fLeafCount") is not None else None
    return (leaf.classname, str(leaf.member("fTitle")), int(leaf.member("fLen")), bool(leaf.member("fIsUnsigned")),
            count)


def reuse_interpretations(tree, names, plans: dict) -> int:
    """Give the plain branches ``names`` of ``tree`` the interpretation ``plans`` holds for their
    key (:func:`interpretation_key`), identifying and adding the new ones; the number reused. Does
    nothing where uproot has no ``_interpretation`` slot."""
    reused = 0
    for name in names:
        b = tree[name]
        if getattr(b, "_interpretation", 0) is not None:
            continue                                   # already identified, or no such slot
        key = interpretation_key(b)
        if key is None:
            continue
        if key in plans:
            b._interpretation = plans[key]
            reused += 1
        else:
            plans[key] = b.interpretation
    return reused


def use_fast_zlib(enable: bool = True) -> str:
    """Decompress ZLIB baskets with ISA-L when ``isal`` is installed (else zlib, uproot's default);
    the library in use. uproot's documented switch ``uproot.ZLIB.library`` sets the attribute on the
    compression class, but baskets are decompressed by an instance of its base class
    (``uproot.compression._DecompressZLIB``), so the switch is made there (uproot 5.7.7). Its
    ``"deflate"`` choice calls ``deflate.zlib_decompress(data, bufsize=...)``, which deflate 0.9.0
    refuses (``originalsize``), so it is not offered. ``ZLIB`` (the writer) inherits the attribute,
    and ISA-L compresses level 1 as its level 0 (larger files), so the writer keeps its own value."""
    from uproot import compression

    cls = getattr(compression, "_DecompressZLIB", None)
    if cls is None or not hasattr(cls, "library"):
        return "zlib"
    if not enable:                                   # back to uproot's default (bench/ingest.py --ab)
        cls.library = "zlib"
        return "zlib"
    try:
        import isal.isal_zlib  # noqa: F401
    except ImportError:
        return cls.library
    writer = getattr(compression, "ZLIB", None)
    if writer is not None and "library" not in vars(writer):
        writer.library = "zlib"                  # writing (ZLIB.compress) keeps uproot's default
    cls.library = "isal"
    return "isal"


def memoize_classnames(enable: bool = True) -> bool:
    """Cache uproot's ``uproot.model.classname_regularize`` (a pure function of a class name,
    looked up on the module at every call; ``enable=False`` puts uproot's own back); False when
    this uproot has no such function."""
    import functools

    from uproot import model

    f = getattr(model, "classname_regularize", None)
    if not callable(f):
        return False
    if not enable:
        model.classname_regularize = getattr(f, "__wrapped__", f)
    elif not hasattr(f, "cache_info"):
        model.classname_regularize = functools.lru_cache(maxsize=4096)(f)
    return True

