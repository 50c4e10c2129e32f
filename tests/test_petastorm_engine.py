"""The Petastorm engine (``loader.engine: petastorm``): Petastorm's make_batch_reader reads the
shard stage's own shards (fixed-size binary tensor columns) and plain list shards, with the native
engines' contracts: every row once per epoch, a batch order fixed by the seed, resumable by
skipping batches, the global RNGs untouched, s3:// shards read in place; and training through it
(the Worker's own reader call) sees the same samples per epoch as through the native engine."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data.shard_reader import ShardReader, epoch_seed
from pipeline.errors import BadInputError
from pipeline.shards.manifest import load_manifest
from servers import environment, s3_server
from train_fixtures import mnist_digits, write_digit_shards

pytestmark = pytest.mark.needs_petastorm


def _digits_source(root, n=400):
    X, y = mnist_digits()
    ids = np.sort(np.random.default_rng(3).permutation(len(y))[:n])     # all ten classes (the file is sorted)
    src = root / "src"
    src.mkdir()
    pq.write_table(pa.table({
        "sample_id": ids.astype(np.int64), "label": y[ids].astype(np.int64),
        "image": pa.array(list(X[ids].astype(np.uint8)), pa.list_(pa.uint8())),
        "height": np.full(n, 28, np.int32), "width": np.full(n, 28, np.int32), "channels": np.ones(n, np.int32),
        "split": np.where(np.arange(n) < 300, "train", np.where(np.arange(n) < 350, "test", "val"))}),
        src / "part-0.parquet", row_group_size=64)
    return src


def _held_ids(man) -> list[list[int]]:
    """Each worker's sample ids, sorted: the manifest's ranges where it lists them (the hand-written
    list shards), else what the pure assignment function gives the layout over the source's train
    rows, sorted by id (the shard stage leaves the ranges out)."""
    from pipeline.shards.schemes import assign, expand_ranges, layout_from_manifest

    if all(w.sample_ids for w in man.workers):
        return [expand_ranges([list(r) for r in w.sample_ids]).tolist() for w in man.workers]
    src = pq.read_table(man.source, columns=["sample_id", "split"]).to_pydict()
    train = np.sort([i for i, s in zip(src["sample_id"], src["split"]) if s == "train"])
    a = assign(layout_from_manifest(man.layout.model_dump()), man.n_train_samples)
    return [sorted(train[m].tolist()) for m in a.members]


@pytest.fixture(scope="module")
def tensor_shards(spark, tmp_path_factory):
    """The shard stage's layout (image as a fixed-size binary tensor column), 2 workers, 32-row groups."""
    from pipeline.shards.materialize import ShardConfig, shard

    root = tmp_path_factory.mktemp("pt")
    man = shard(ShardConfig(input=str(_digits_source(root)), output=str(root / "shards"), workers=2,
                            row_group_rows=32, seed=0), spark=spark)
    assert man["tensors"]["image"]                      # really the tensor layout
    return root / "shards" / "manifest.json"


@pytest.fixture(scope="module")
def list_shards(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("pl") / "shards", workers=2, n_train=320, n_test=64,
                              n_val=64, row_group_rows=32)


def _read(path, seed, engine="petastorm", batch=24, skip=0, limit=None, shuffle=True, **kw):
    with ShardReader(path, batch, "image", seed=seed, shuffle=shuffle, shuffle_buffer=kw.pop("shuffle_buffer", 64),
                     with_ids=True, engine=engine, **kw) as r:
        assert r.mode == ("petastorm" if engine == "petastorm" else r.mode)
        return [(x[0].clone(), y.clone(), ids.clone()) for x, y, ids in r.batches(skip_batches=skip,
                                                                                  limit_batches=limit)]


def _row_groups(path) -> dict:
    """sample_id -> (file, row group) of a local shard, read with plain pyarrow."""
    out = {}
    for f in sorted(Path(path).glob("*.parquet")):
        pf = pq.ParquetFile(f)
        for g in range(pf.num_row_groups):
            out.update({i: (f.name, g) for i in pf.read_row_group(g, columns=["sample_id"]).column(0).to_pylist()})
    return out


def _ids(batches):
    return torch.cat([b[2] for b in batches]).tolist()


def test_a_worker_directory_is_readable_by_plain_petastorm(tensor_shards):
    from petastorm import make_batch_reader

    from pipeline.outputs import uri

    man = load_manifest(str(tensor_shards))
    w = man.workers[1]
    with make_batch_reader(uri(w.path), num_epochs=1, reader_pool_type="dummy",
                           schema_fields=["sample_id", "label"], shuffle_row_groups=False) as reader:
        got = np.concatenate([b.sample_id for b in reader])
    assert np.sort(got).tolist() == _held_ids(man)[1]


@pytest.mark.parametrize("layout", ["tensor", "list"])
def test_every_row_once_in_an_order_fixed_by_the_seed(tensor_shards, list_shards, layout):
    man = load_manifest(str(tensor_shards if layout == "tensor" else list_shards))
    w = man.workers[0]
    expected = _held_ids(man)[0]
    seed = epoch_seed(0, w.seed, 0)
    a = _read(w.path, seed)
    assert sorted(_ids(a)) == expected                                  # every row exactly once
    assert [len(b[2]) for b in a] == [24] * (w.rows // 24) + ([w.rows % 24] if w.rows % 24 else [])
    assert _ids(_read(w.path, seed)) == _ids(a)                         # same seed, same batches
    nxt = _read(w.path, epoch_seed(0, w.seed, 1))
    assert _ids(nxt) != _ids(a) and sorted(_ids(nxt)) == expected       # next epoch: reshuffled
    group = _row_groups(w.path)                                         # rows are mixed across row groups
    assert len({group[i] for i in _ids(a)[:24]}) > 1
    # resume: skipping k batches gives exactly the rest of the uninterrupted epoch; limit stops early
    assert [b[2].tolist() for b in _read(w.path, seed, skip=5)] == [b[2].tolist() for b in a[5:]]
    assert [b[2].tolist() for b in _read(w.path, seed, skip=2, limit=4)] == [b[2].tolist() for b in a[2:4]]


def test_both_engines_give_the_same_samples_and_the_same_file_order(tensor_shards):
    man = load_manifest(str(tensor_shards))
    X, labels = mnist_digits()
    for w in man.workers:
        for epoch in (0, 1):
            seed = epoch_seed(7, w.seed, epoch)
            pet = _read(w.path, seed)
            native = {mode: _read(w.path, seed, engine="native", mode=mode) for mode in ("memory", "stream")}
            for nat in native.values():
                assert sorted(zip(_ids(pet), torch.cat([b[1] for b in pet]).tolist())) == \
                    sorted(zip(_ids(nat), torch.cat([b[1] for b in nat]).tolist()))
        # unshuffled: file order, batch for batch identical to the native engines
        pet = _read(w.path, 0, shuffle=False, batch=50)
        nat = _read(w.path, 0, shuffle=False, batch=50, engine="native", mode="stream")
        assert len(pet) == len(nat)
        for (xa, ya, ia), (xb, yb, ib) in zip(pet, nat):
            assert torch.equal(ia, ib) and torch.equal(ya, yb) and torch.equal(xa, xb)
    (x, y, ids) = pet[0]
    i = int(ids[3])
    assert np.allclose(x[3, 0].numpy(), X[i].reshape(28, 28) / 255.0) and int(y[3]) == int(labels[i])


def test_reading_leaves_every_global_rng_untouched(tensor_shards):
    w = load_manifest(str(tensor_shards)).workers[1]
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    _read(w.path, 9)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1] and np.array_equal(np.random.get_state()[1], before[2])


def test_stopping_early_stops_petastorms_threads(tensor_shards):
    import threading

    w = load_manifest(str(tensor_shards)).workers[0]
    before = threading.active_count()
    with ShardReader(w.path, 8, "image", seed=1, engine="petastorm") as r:
        it = r.batches()
        next(it)
        it.close()
    assert threading.active_count() == before
    with ShardReader(w.path, 8, "image", seed=1, engine="petastorm") as r:
        kept = r.batches()                     # still referenced after the block: closed by the reader
        next(kept)
        assert threading.active_count() > before
    assert threading.active_count() == before


def test_the_reader_reads_ahead_while_a_batch_is_held(tmp_path):
    """Petastorm ventilates a row group only after its consumer took the ones before: the engine
    drains the reader on a thread of its own, so row groups keep coming while training holds the
    batches of a window (without it the reader stalls for every step: bench/loader.py)."""
    import time

    from pipeline.data.petastorm_engine import PetastormShard

    man = write_digit_shards(tmp_path / "s", workers=1, n_train=320, n_test=16, n_val=16, row_group_rows=8)
    eng = PetastormShard(load_manifest(str(man)).workers[0].path, ["image", "label"], shuffle_buffer=8, queue_size=6)
    taken, decoded = [], eng.decoded

    def counted(reader):
        for part in decoded(reader):
            taken.append(len(part["label"]))
            yield part

    eng.decoded = counted
    it = eng.epoch(seed=1, batch_size=8, shuffle=True)
    first = next(it)                   # one batch handed out and held (the window is one row group)
    deadline = time.monotonic() + 30
    while len(taken) < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(taken) >= 7, f"only {len(taken)} row groups left Petastorm while a batch was held"
    rows = len(first["label"]) + sum(len(b["label"]) for b in it)
    assert rows == 320                 # and the epoch is still every row once


def test_bad_shards_are_one_line_naming_the_file_and_column(tmp_path):
    ragged = tmp_path / "ragged"
    ragged.mkdir()
    pq.write_table(pa.table({"label": [0, 1], "hlf": pa.array([[1.0] * 14, [1.0] * 13], pa.list_(pa.float32()))}),
                   ragged / "p.parquet")
    with pytest.raises(BadInputError, match=r"ragged: column 'hlf' has lists of several lengths"):
        with ShardReader(str(ragged), 2, "hlf", engine="petastorm") as r:
            list(r)
    nulls = tmp_path / "nulls"
    nulls.mkdir()
    pq.write_table(pa.table({"label": pa.array([0, None], pa.int64()),
                             "hlf": pa.array([[1.0] * 14] * 2, pa.list_(pa.float32()))}), nulls / "p.parquet")
    with pytest.raises(BadInputError, match=r"nulls: column 'label' has null value"):
        with ShardReader(str(nulls), 2, "hlf", engine="petastorm") as r:
            list(r)


def test_training_sees_the_same_samples_per_epoch_through_both_engines(tensor_shards, tmp_path):
    """The Worker's own reader call (``Worker.batches``, what every schedule iterates) with
    ``loader.engine`` native and petastorm: per epoch the same multiset of (input, label), the
    Petastorm order fixed by the seed, and every batch trains."""
    from pipeline.train.comm.local import LocalCommunicator
    from pipeline.train.config import TrainConfig
    from pipeline.train.launch import make_plan
    from pipeline.train.worker import Worker

    man = load_manifest(str(tensor_shards))
    one = tmp_path / "one.json"                      # a one-worker manifest over worker 0's shard
    man.model_copy(update={"workers": man.workers[:1], "layout": man.layout.model_copy(update={"workers": 1})}).write(one)

    def samples(engine):
        cfg = TrainConfig(manifest=str(one), output=str(tmp_path / engine), launcher="local", batch_size=16,
                          epochs=2, optimizer="sgd", lr=0.01, progress=False, loader={"engine": engine})
        (tmp_path / engine).mkdir(exist_ok=True)
        w = Worker(cfg, LocalCommunicator(), {**make_plan(cfg), "resume_from": None}, str(tmp_path / engine),
                   str(tmp_path / "ck"), torch.device("cpu"))
        w.start(resume=False)
        epochs = []
        for epoch in (0, 1):
            rows = []
            with w.batches(epoch) as batches:
                for (x,), y in batches:
                    rows += [(int(label), bytes(r.numpy().tobytes())) for r, label in zip(x, y)]
                    assert np.isfinite(w.train_step((x,), y, lr_step=w.step))
            epochs.append(rows)
        return epochs, w.step

    pet, pet_steps = samples("petastorm")
    nat, nat_steps = samples("native")
    assert pet_steps == nat_steps == 2 * -(-man.workers[0].rows // 16)
    for e in (0, 1):
        assert len(pet[e]) == man.workers[0].rows and sorted(pet[e]) == sorted(nat[e])
    assert pet[0] != pet[1]                                               # reshuffled per epoch
    assert samples("petastorm")[0] == pet                                 # and the same again


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


def test_petastorm_engine_reads_s3_shards_in_place(spark, s3, tensor_shards, tmp_path):
    from pipeline.shards.materialize import ShardConfig, shard

    uri = f"s3://{s3.bucket}/petastorm/shards"
    with environment(**s3.env("writer")):
        shard(ShardConfig(input=str(tensor_shards.parent.parent / "src"), output=uri, workers=2, row_group_rows=32,
                          seed=0), spark=spark)
    local = load_manifest(str(tensor_shards)).workers[1].path
    ref = _read(local, 3)
    with environment(**s3.env("reader")):                      # read-only credentials are enough
        got = _read(f"{uri}/worker_001", 3)
    assert len(got) == len(ref) > 3
    for (xa, ya, ia), (xb, yb, ib) in zip(got, ref):
        assert torch.equal(ia, ib) and torch.equal(ya, yb) and torch.equal(xa, xb)
