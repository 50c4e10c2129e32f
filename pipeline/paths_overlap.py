"""No output inside an input, and no input inside an output: the one check every stage runs on its
locations before any work (a commit replaces the whole output location, so an input inside it
would be lost, and an output inside an input would be read as input by the next run).

Two locations overlap when they are the same or one lies inside the other, compared as whole path
components (``out`` and ``out2`` do not overlap). Local paths are compared after
:func:`os.path.realpath` (symlinks and ``..`` resolved); ``s3://`` prefixes (``s3a://``/``s3n://``
are the same store, :func:`pipeline.fs.location`) by bucket and key, as written and with ``.``/``..``
folded, an overlap in either form counting. Locations on different filesystems never overlap;
``root://`` and ``http(s)://`` inputs are read by uproot and never written.
"""
from __future__ import annotations

import os
import posixpath
from typing import Iterable, Union

from .errors import ConfigError
from .fs import Location, location
from .marker import refuse_foreign

PathLike = Union[str, "os.PathLike[str]", Location]


def _forms(loc: PathLike) -> tuple[str, list[str]]:
    """(scheme, the comparable forms of the path, each ending in ``/``)."""
    loc = location(loc)
    if loc.scheme == "file":
        return "file", [os.path.realpath(loc.path).rstrip("/") + "/"]
    if loc.scheme == "s3":
        raw = "/".join(p for p in loc.path.split("/") if p)
        folded = posixpath.normpath("/" + raw).lstrip("/")
        return "s3", list(dict.fromkeys([raw + "/", folded + "/"]))
    return loc.scheme, []        # root://, http(s)://: never written by a stage


def overlaps(a: PathLike, b: PathLike) -> bool:
    """``a`` and ``b`` are the same location or one lies inside the other."""
    sa, fa = _forms(a)
    sb, fb = _forms(b)
    return sa == sb and any(x.startswith(y) or y.startswith(x) for x in fa for y in fb)


def check_apart(output: PathLike, inputs: Iterable[PathLike], *, output_name: str = "output",
                input_name: str = "input", replaces: bool = True) -> None:
    """ConfigError (one line naming both paths, exit 2) when ``output`` overlaps any of ``inputs``;
    BadInputError (one line naming the first foreign file) when a local ``output`` is not ours to
    replace (:func:`pipeline.marker.refuse_foreign`: checked here so that it comes before any work,
    Spark's start included; an ``s3://`` output is checked when its job begins). ``replaces``
    false: the output is not replaced (a Delta table a run appends to), so only the overlap is checked."""
    out = location(output)
    for inp in inputs:
        if overlaps(out, inp):
            inp = location(inp)
            where = ("is the same location as" if _forms(out) == _forms(inp) else
                     "lies inside" if any(x.startswith(y) for x in _forms(inp)[1] for y in _forms(out)[1]) else
                     "contains")
            raise ConfigError(f"{output_name}={out} overlaps {input_name}={inp} (the {input_name} {where} the "
                              f"{output_name}); an output may not lie inside an input nor hold one: choose another "
                              f"{output_name}")
    if out.is_local and output_name == "output" and replaces:
        refuse_foreign(out)
