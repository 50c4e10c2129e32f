"""The filesystem adapter between :mod:`pipeline.fs` and Petastorm's readers (the one place that
knows Petastorm's filesystem needs; imported only by the Petastorm engine, never at import time of
anything else).

Petastorm 0.12 hands its filesystem to pyarrow's legacy ``ParquetDataset``, which accepts only the
deprecated ``pyarrow.filesystem`` interface (gone from current pyarrow releases): for an object
store, the pyarrow S3 client of :mod:`pipeline.fs` (same endpoint and credentials) is wrapped into
that interface through fsspec's ``ArrowFSWrapper``. Local shards keep Petastorm's own ``file://``
handling.
"""
from __future__ import annotations

import warnings

from fsspec.implementations.arrow import ArrowFSWrapper

from ..errors import BadInputError
from ..fs import Location, s3_filesystem, s3_settings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import pyarrow.filesystem as legacy


def petastorm_filesystem(loc: Location):
    """``(dataset_url, filesystem)`` for Petastorm's ``make_batch_reader`` (``filesystem=None``
    for a local path: Petastorm opens ``file://`` itself)."""
    if loc.is_local:
        return "file://" + loc.path, None
    if loc.scheme != "s3":
        raise BadInputError(f"{loc}: shards can be read from local paths and s3:// only")
    _register_fsspec_s3()
    return "s3://" + loc.path, LegacyFsspec(ArrowFSWrapper(loc.filesystem()))


class LegacyFsspec(legacy.DaskFileSystem):
    """pyarrow's legacy filesystem interface over any fsspec filesystem (what Petastorm 0.12 needs)."""

    def isdir(self, path):
        return self.fs.isdir(path)

    def isfile(self, path):
        return self.fs.isfile(path)

    def walk(self, top_path):
        return self.fs.walk(top_path)


def _register_fsspec_s3() -> None:
    """Petastorm strips ``s3://`` through fsspec's registry; where s3fs is not installed, register
    fsspec's S3 protocol over the pyarrow client (same endpoint and credentials as :func:`s3_settings`)."""
    import fsspec

    try:
        fsspec.get_filesystem_class("s3")
        return
    except ImportError:
        pass

    class ArrowS3(ArrowFSWrapper):
        protocol = ("s3", "s3a")
        root_marker = ""

        def __init__(self, **kwargs):
            super().__init__(s3_filesystem(**s3_settings()), **kwargs)

        @classmethod
        def _strip_protocol(cls, path):
            path = path.split("://", 1)[-1] if "://" in path else path
            return path.strip("/")

    fsspec.register_implementation("s3", ArrowS3, clobber=True)
