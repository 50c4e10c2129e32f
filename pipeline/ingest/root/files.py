"""Which ROOT files an ``input`` names: paths, globs, ``samples:NAME``, ``root://`` globs listed
by the server, ``http(s)://`` URLs."""
from __future__ import annotations

import glob
import os
from typing import Iterable, Union

from ...errors import ConfigError
from ...fs import expand_remote_glob, location
from ...redact import expand_path
from ...samples import coffea_samples
from .config import SAMPLES_PREFIX


def _as_list(v: Union[str, Iterable[str]]) -> list[str]:
    if isinstance(v, str):
        return [s.strip() for s in v.split(",")] if "," in v and "://" not in v else [v]
    return [str(x) for x in v]


def sample_path(item: str) -> str:
    """``samples:NAME`` as the path of that file of the cached coffea samples
    (:func:`pipeline.samples.coffea_samples`); any other item as it is."""
    if item.startswith(SAMPLES_PREFIX):
        return str(coffea_samples() / item[len(SAMPLES_PREFIX):])
    return item


def resolve_files(inputs: Union[str, Iterable[str]]) -> list[str]:
    """Expand paths/globs (sorted, de-duplicated, order of the patterns kept).

    ``samples:NAME`` is a file of the cached coffea samples (:func:`pipeline.samples.coffea_samples`);
    ``s3a://`` and ``s3n://`` (Spark's names of the same objects) are ``s3://``, so every later step
    (the tasks' credentials, the reader, the report) sees one name; a ``root://`` or ``s3://`` glob is
    listed by the server (:func:`pipeline.fs.expand_remote_glob`), other URLs (``root://``,
    ``http(s)://``) are passed through. A plain path or URL that does not exist
    is kept (it is reported as a bad file later); a glob that matches nothing is a :class:`ConfigError`.
    """
    out: list[str] = []
    for item in _as_list(inputs):
        item = sample_path(item.strip())
        if item.split("://", 1)[0].lower() in ("s3", "s3a", "s3n") and "://" in item:
            item = str(location(item))          # s3://bucket/key, whichever alias was given
        if "://" in item and not item.startswith("file://"):
            hits = expand_remote_glob(item) if item.lower().startswith(("root://", "s3://")) else [item]
            if not hits:
                raise ConfigError(f"input pattern matches no file: {item}")
            out.extend(hits)
            continue
        if item.startswith("file://"):
            item = item[len("file://"):]
        item = expand_path(item)
        if glob.has_magic(item):
            hits = sorted(glob.glob(item, recursive=True))
            if not hits:
                raise ConfigError(f"input pattern matches no file: {item}")
            out.extend(os.path.abspath(h) for h in hits)
        else:
            out.append(os.path.abspath(item))
    uniq = list(dict.fromkeys(out))
    if not uniq:
        raise ConfigError("no input files given")
    return uniq
