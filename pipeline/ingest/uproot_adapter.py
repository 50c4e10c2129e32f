"""The one module that reaches into uproot's internals (``TTree._lookup``).

uproot finds a branch named without its parent's path (``Electron.PT``, not
``Electron/Electron.PT``) by walking the whole branch tree, and ``t.arrays(names)`` does that once
per name: on Delphes' 1105 branches that walk was most of a file's conversion time (quadratic in
the number of branches). ``HasBranches.__getitem__`` first looks the name up in the tree's
``_lookup`` dictionary (its direct sub-branches by name); :func:`index_nested_branches` adds every
nested branch name that occurs once in the tree, so the same branches are found at once. uproot's
public ``filter_name`` selection does not help here: it is slower still on the same file.

``tests/test_uproot_adapter.py`` fails when uproot changes that internal (no ``_lookup``
dictionary, or ``__getitem__`` no longer consulting it); the reading itself stays correct then,
only slower, since :func:`index_nested_branches` does nothing without the dictionary.
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
