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
