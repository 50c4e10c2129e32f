"""The Petastorm reader of a worker's shard: seeded per (worker, epoch), NCHW floats, clear errors."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data.shard_reader import ShardReader, epoch_seed, read_all
from pipeline.errors import BadInputError
from pipeline.shards.manifest import load_manifest
from train_fixtures import mnist_digits, write_digit_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("rd") / "shards", workers=2, n_train=640, n_test=128,
                              n_val=64, row_group_rows=64)


def _epoch(path, seed, batch=32):
    with ShardReader(path, batch, "image", seed=seed, shuffle_buffer=256, with_ids=True) as r:
        return [(x[0], y, ids) for x, y, ids in r]


def test_epoch_covers_shard_once_in_seeded_order(shards):
    man = load_manifest(str(shards))
    w = man.workers[0]
    a = _epoch(w.path, epoch_seed(0, w.seed, 0))
    ids = torch.cat([b[2] for b in a]).numpy()
    expected = {i for a_, b_ in w.sample_ids for i in range(a_, b_ + 1)}
    assert len(ids) == w.rows == len(set(ids.tolist())) and set(ids.tolist()) == expected
    again = torch.cat([b[2] for b in _epoch(w.path, epoch_seed(0, w.seed, 0))]).numpy()
    assert np.array_equal(ids, again)  # same (worker, epoch) -> same order
    nxt = torch.cat([b[2] for b in _epoch(w.path, epoch_seed(0, w.seed, 1))]).numpy()
    assert not np.array_equal(ids, nxt) and sorted(nxt.tolist()) == sorted(ids.tolist())  # next epoch: reshuffled
    assert not np.array_equal(ids[:64], np.sort(ids)[:64])  # actually shuffled, not file order
    other = man.workers[1]
    assert epoch_seed(0, w.seed, 0) != epoch_seed(0, other.seed, 0)


def test_reader_does_not_disturb_model_rng(shards):
    man = load_manifest(str(shards))
    torch.manual_seed(3)
    _epoch(man.workers[0].path, 5)
    x = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(3), x)


def test_images_are_normalised_nchw_and_match_the_pixels(shards):
    man = load_manifest(str(shards))
    X, y = mnist_digits()
    with ShardReader(man.workers[1].path, 16, "image", shuffle=False, with_ids=True) as r:
        (x,), labels, ids = next(iter(r))
    assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    i = int(ids[3])
    assert np.allclose(x[3, 0].numpy(), X[i].reshape(28, 28) / 255.0)
    assert int(labels[3]) == int(y[i])


def test_eval_reading_splits_rows_between_ranks(shards):
    man = load_manifest(str(shards))
    path = man.eval["test"]
    full = torch.cat([y for _, y in read_all(path, "image")])
    parts = [torch.cat([y for _, y in read_all(path, "image", batch_size=50, rank=r, world=3)]) for r in range(3)]
    assert sum(len(p) for p in parts) == len(full) == 128
    assert [len(p) for p in parts] == [42, 43, 43]   # contiguous slices [N r / 3, N (r + 1) / 3)
    assert torch.equal(torch.cat(parts), full)


@pytest.mark.parametrize("layout", ["padded", "real particles only"])
def test_llf_scaling_keeps_padding_zero(tmp_path, layout):
    """LLF lists padded to 801 x 19 (schema v2), or of the real particles only with ``pad_to``
    (v3, as the feature stage writes them; padded by the reader): the same scaled tensors,
    padding exactly zero."""
    from pipeline.schemas import PAD_KEY, pad_length
    from pipeline.features.rows import llf_lists

    rng = np.random.default_rng(0)
    n_part = np.array([3, 801, 0, 10], np.int32)
    llf = np.zeros((4, 801, 19), np.float32)
    for i, n in enumerate(n_part):
        llf[i, :n] = rng.normal(5, 2, (n, 19))
    d = tmp_path / "llf"
    d.mkdir()
    if layout == "padded":
        col, meta = pa.array(list(llf.reshape(4, -1)), type=pa.list_(pa.float32())), None
    else:
        col, meta = llf_lists(llf.reshape(4, -1), n_part), {PAD_KEY: b"15219"}
        assert [len(v) for v in col.to_pylist()] == [19 * 3, 19 * 801, 0, 19 * 10]
    t = pa.table({"sample_id": np.arange(4), "label": np.array([0, 1, 2, 1]), "llf": col, "n_particles": n_part,
                  "hlf": pa.array(list(rng.normal(size=(4, 14)).astype(np.float32)), type=pa.list_(pa.float32()))})
    t = t.cast(t.schema.set(2, t.schema.field("llf").with_metadata(meta)))
    pq.write_table(t, d / "p.parquet")
    assert (pad_length(pq.read_schema(d / "p.parquet").field("llf")) is None) == (layout == "padded")
    scaling = {"llf": {"mean": [5.0] * 19, "std": [2.0] * 19}, "hlf": {"mean": [0.0] * 14, "std": [1.0] * 14}}
    with ShardReader(str(d), 4, "inclusive", shuffle=False, scaling=scaling) as r:
        (x, n, h), y = next(iter(r))
    assert x.shape == (4, 801, 19) and h.shape == (4, 14)
    assert torch.equal(n, torch.tensor([3, 801, 0, 10]))
    assert float(x[0, 3:].abs().max()) == 0.0 and float(x[2].abs().max()) == 0.0
    assert torch.allclose(x[0, :3], (torch.from_numpy(llf[0, :3]) - 5) / 2)
    assert torch.allclose(x[1], (torch.from_numpy(llf[1]) - 5) / 2)


def test_manifest_errors_name_file_and_key(tmp_path, shards):
    with pytest.raises(BadInputError, match="not found"):
        load_manifest(str(tmp_path / "nope.json"))
    m = json.loads(shards.read_text())
    del m["eval"]
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps(m))
    with pytest.raises(BadInputError, match=r"manifest.json: manifest key 'eval' missing"):
        load_manifest(str(p))
    m = json.loads(shards.read_text())
    m["layout"]["copies"] = 3
    p.write_text(json.dumps(m))
    with pytest.raises(BadInputError, match="copies=3"):
        load_manifest(str(p))


def test_overlap_epoch_rule(shards):
    man = load_manifest(str(shards))
    assert man.copies == 1 and man.overlap_epochs(5) == 5
    man.layout.copies = 2
    assert [man.overlap_epochs(e) for e in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]


# --------------------------------------------------------------------------- both batching modes
def _ids(path, mode, seed, batch=24, skip=0, limit=None, **kw):
    with ShardReader(path, batch, "image", seed=seed, shuffle_buffer=kw.pop("shuffle_buffer", 100), with_ids=True,
                     mode=mode, **kw) as r:
        assert r.mode == mode
        return [b[2].clone() for b in r.batches(skip_batches=skip, limit_batches=limit)]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_each_mode_is_seeded_exactly_once_and_resumable(shards, mode):
    man = load_manifest(str(shards))
    w = man.workers[0]
    expected = sorted(i for a_, b_ in w.sample_ids for i in range(a_, b_ + 1))
    a = _ids(w.path, mode, 11)
    flat = torch.cat(a).tolist()
    assert sorted(flat) == expected                      # every row exactly once
    assert [len(b) for b in a] == [24] * (w.rows // 24) + ([w.rows % 24] if w.rows % 24 else [])
    assert [b.tolist() for b in _ids(w.path, mode, 11, decode_threads=3)] == [b.tolist() for b in a]
    b = _ids(w.path, mode, 12)
    assert torch.cat(b).tolist() != flat and sorted(torch.cat(b).tolist()) == expected
    # rows of one 64-row row group are spread over the epoch, not kept together
    first_group = set(flat[:24])
    assert len(first_group & set(range(min(first_group), min(first_group) + 64))) < 24
    # resume: skipping k batches gives exactly the rest of the uninterrupted epoch; limit stops early
    resumed = _ids(w.path, mode, 11, skip=5)
    assert [x.tolist() for x in resumed] == [x.tolist() for x in a[5:]]
    assert [x.tolist() for x in _ids(w.path, mode, 11, skip=2, limit=4)] == [x.tolist() for x in a[2:4]]


def test_memory_and_stream_modes_give_the_same_rows_and_unshuffled_order(shards):
    man = load_manifest(str(shards))
    w = man.workers[1]
    mem, stream = _ids(w.path, "memory", 3), _ids(w.path, "stream", 3)
    assert sorted(torch.cat(mem).tolist()) == sorted(torch.cat(stream).tolist())
    with ShardReader(w.path, 50, "image", shuffle=False, with_ids=True, mode="memory") as r:
        m = [(x[0], y, i) for x, y, i in r]
    with ShardReader(w.path, 50, "image", shuffle=False, with_ids=True, mode="stream") as r:
        s = [(x[0], y, i) for x, y, i in r]
    assert len(m) == len(s) and all(torch.equal(a[k], b[k]) for a, b in zip(m, s) for k in range(3))


def test_auto_mode_follows_the_memory_budget(shards):
    w = load_manifest(str(shards)).workers[0]
    with ShardReader(w.path, 32, "image", memory_budget=10**9) as r:
        assert r.mode == "memory"
    with ShardReader(w.path, 32, "image", memory_budget=1000) as r:
        assert r.mode == "stream"


def test_memory_mode_decodes_the_shard_once_per_process(shards):
    from pipeline.data.engines import MemoryShard

    w = load_manifest(str(shards)).workers[0]
    with ShardReader(w.path, 32, "image", seed=1, mode="memory") as r:
        first = r._engine
    with ShardReader(w.path, 32, "image", seed=2, mode="memory") as r:
        assert r._engine is first
    with ShardReader(w.path, 32, "image", seed=2, mode="memory", with_ids=True) as r:
        assert r._engine is not first                     # other columns: decoded again
    assert len(MemoryShard._cache) == 1


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_reading_never_touches_the_global_rng(shards, mode):
    w = load_manifest(str(shards)).workers[0]
    torch.manual_seed(5)
    before = torch.get_rng_state()
    _ids(w.path, mode, 9)
    assert torch.equal(torch.get_rng_state(), before)


def test_ragged_list_column_is_one_clear_error(tmp_path):
    d = tmp_path / "ragged"
    d.mkdir()
    pq.write_table(pa.table({"label": [0, 1], "hlf": pa.array([[1.0] * 14, [1.0] * 13], pa.list_(pa.float32()))}),
                   d / "p.parquet")
    for mode in ("memory", "stream"):
        with pytest.raises(BadInputError, match=r"column 'hlf' has lists of lengths 13..14"):
            with ShardReader(str(d), 2, "hlf", mode=mode) as r:
                list(r)


def test_device_prefetcher_copies_on_a_background_thread_in_order():
    """The prefetch path (thread, queue, copies, error hand-over) with an injected device."""
    import threading

    from pipeline.data.prefetch import DevicePrefetcher

    producer = []

    def gen():
        for i in range(7):
            producer.append(threading.current_thread().name)
            yield (torch.full((2,), i),), torch.tensor([i])
    got = list(DevicePrefetcher(gen(), "cpu", depth=2, pin=False))
    assert [int(y) for _, y in got] == list(range(7))
    assert set(producer) == {"pipeline-prefetch"}

    def bad():
        yield (torch.zeros(1),), torch.zeros(1)
        raise BadInputError("x.parquet: broken")
    it = iter(DevicePrefetcher(bad(), "cpu", pin=False))
    next(it)
    with pytest.raises(BadInputError, match="x.parquet: broken"):
        next(it)
    # stopping early ends the thread
    it = iter(DevicePrefetcher(gen(), "cpu", depth=1, pin=False))
    next(it)
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "pipeline-prefetch"]


def test_tensor_and_list_layouts_read_identically(spark, tmp_path):
    """Shards written by the shard stage as tensors (default) or as lists give the same batches."""
    from pipeline.shards.materialize import ShardConfig, shard

    X, y = mnist_digits()
    n = 300
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({
        "sample_id": np.arange(n, dtype=np.int64), "label": y[:n].astype(np.int64),
        "image": pa.array(list(X[:n].reshape(n, -1).astype(np.uint8)), pa.list_(pa.uint8())),
        "height": np.full(n, 28, np.int32), "width": np.full(n, 28, np.int32), "channels": np.ones(n, np.int32),
        "split": np.where(np.arange(n) < 250, "train", "test")}), src / "part-0.parquet", row_group_size=64)
    got = {}
    for name, cols in (("tensor", ["image"]), ("list", [])):
        man = shard(ShardConfig(input=str(src), output=str(tmp_path / name), workers=1, row_group_rows=32,
                                tensor_columns=cols), spark=spark)
        assert set(man["tensors"]) == set(cols)
        for mode in ("memory", "stream"):
            with ShardReader(man["workers"][0]["path"], 20, "image", seed=4, mode=mode, with_ids=True) as r:
                got[name, mode] = list(r)
    for mode in ("memory", "stream"):
        a, b = got["tensor", mode], got["list", mode]
        assert len(a) == len(b) == 13
        for (xa, ya, ia), (xb, yb, ib) in zip(a, b):
            assert torch.equal(ia, ib) and torch.equal(ya, yb) and torch.equal(xa[0], xb[0])
    (x,), labels, ids = got["tensor", "memory"][0]
    i = int(ids[0])
    assert np.allclose(x[0, 0].numpy(), X[i].reshape(28, 28) / 255.0) and int(labels[0]) == int(y[i])


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_float_images_are_scaled_without_touching_the_engines_data(tmp_path, mode):
    """The images stage stores pixels as float32 0..255 lists: scaling them must not write into
    the engine's buffers (the cached shard of the memory mode, the window of the stream mode),
    so reading the same shard again gives the same batches."""
    X, y = mnist_digits()
    d = tmp_path / "float-images"
    d.mkdir()
    n = 96
    pq.write_table(pa.table({
        "sample_id": np.arange(n, dtype=np.int64), "label": y[:n].astype(np.int64),
        "image": pa.array(list(X[:n].astype(np.float32)), pa.list_(pa.float32())),
        "height": np.full(n, 28, np.int32), "width": np.full(n, 28, np.int32), "channels": np.ones(n, np.int32)}),
        d / "p.parquet", row_group_size=32)
    reads = []
    for _ in range(2):
        with ShardReader(str(d), 16, "image", shuffle=False, mode=mode, with_ids=True) as r:
            reads.append([(x[0], ids) for x, _, ids in r])
    for (xa, ia), (xb, ib) in zip(*reads):
        assert torch.equal(ia, ib) and torch.equal(xa, xb)
        assert np.allclose(xa[:, 0].numpy(), X[ia.numpy()].reshape(-1, 28, 28) / 255.0)


@pytest.mark.parametrize("statistics", [True, False])
def test_label_count_from_the_footers_or_the_column(tmp_path, statistics):
    """The plan counts classes from the row groups' statistics (no label column decoded); a file
    written without statistics is read instead. Same answer either way, the largest label in any
    row group of any directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.shard_reader import label_count

    for d, labels in (("a", [0, 3, 1]), ("b", [2, 6, 0])):
        (tmp_path / d).mkdir()
        t = pa.table({"x": pa.array([[1.0, 2.0]] * 3), "label": pa.array(labels, pa.int64())})
        pq.write_table(t, tmp_path / d / "part-0.parquet", row_group_size=1, write_statistics=statistics)
    assert label_count([str(tmp_path / "a")]) == 4
    assert label_count([str(tmp_path / "a"), str(tmp_path / "b")]) == 7
