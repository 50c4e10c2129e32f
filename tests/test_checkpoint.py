"""Checkpoints on their own: per-rank files with hashes, a corrupt or half-written newest one
skipped with a warning naming it, keep-last-K, the RNG round trip (CPU, and CUDA through an
injected probe), and where a run starts for each ``resume`` setting."""
from __future__ import annotations

import io
import json
import logging
import random

import numpy as np
import pytest
import torch

from pipeline.errors import BadInputError, ConfigError
from pipeline.train import checkpoint, restart
from pipeline.train.comm import make_communicator
from pipeline.train.config import TrainConfig


class _State:
    """Anything with state_dict/load_state_dict (the algorithm slot of a checkpoint)."""

    def __init__(self, v=0):
        self.v = v

    def state_dict(self):
        return {"v": self.v}

    def load_state_dict(self, st):
        self.v = st["v"]


def _parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 6)).sum().backward()
    opt.step()  # momentum buffers exist
    return model, opt, _State(seed)


def _write(comm, d, step, seed=0, keep=0, fp=None):
    model, opt, algo = _parts(seed)
    meta = {"elapsed_s": float(step), "fingerprint": fp or {"seed": 0}, "metrics": [{"step": step}]}
    return checkpoint.write(comm, str(d), step, model, opt, algo, meta, keep=keep)


@pytest.fixture
def comm():
    c = make_communicator("local")
    yield c
    c.shutdown()


def test_write_then_restore_round_trips_model_optimizer_algorithm_and_every_rng(tmp_path, comm):
    model, opt, algo = _parts(1)
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(9)
    path = checkpoint.write(comm, str(tmp_path), 4, model, opt, algo,
                            {"elapsed_s": 1.5, "fingerprint": {"seed": 0}, "metrics": [{"step": 2}]})
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    files = sorted(p.name for p in (tmp_path / "step_00000004").iterdir())
    assert files == ["meta.json", "rank_000.pt"]  # no temporary file left
    meta = json.loads((tmp_path / "step_00000004" / "meta.json").read_text())
    assert meta["files"]["rank_000.pt"]["bytes"] == (tmp_path / "step_00000004" / "rank_000.pt").stat().st_size
    m2, o2, a2 = _parts(2)  # different weights, momentum, algorithm state, and RNG moved on
    torch.rand(10), np.random.rand(10), random.random()
    got = checkpoint.restore(path, 0, m2, o2, a2)
    assert got["step"] == 4 and got["elapsed_s"] == 1.5 and got["metrics"] == [{"step": 2}]
    for a, b in zip(model.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], o2.state_dict()["state"][0]["momentum_buffer"])
    assert a2.v == 1
    again = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]


class FakeCuda:
    """The CUDA probe of a 2-GPU host (checkpoint.rng_state/set_rng_state take it as ``cuda``)."""

    def __init__(self, n=2, fill=3):
        self.n = n
        self.states = [torch.full((16,), fill + i, dtype=torch.uint8) for i in range(n)]
        self.restored = None

    def is_available(self):
        return True

    def device_count(self):
        return self.n

    def get_rng_state_all(self):
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, states):
        self.restored = [s.clone() for s in states]


def test_cuda_rng_states_are_saved_and_restored_through_the_probe(tmp_path, comm):
    model, opt, algo = _parts()
    blob = checkpoint.rank_bytes(model, opt, algo, cuda=FakeCuda(fill=3))
    st = torch.load(io.BytesIO(blob), weights_only=True)  # RNG states are tensors and plain data
    assert [s.tolist()[0] for s in st["rng"]["cuda"]] == [3, 4]
    probe = FakeCuda(fill=50)
    checkpoint.set_rng_state(st["rng"], cuda=probe)
    assert [s.tolist()[0] for s in probe.restored] == [3, 4]
    # a host without CUDA records none and restores none
    cpu_only = checkpoint.rng_state(cuda=type("NoCuda", (), {"is_available": lambda self: False})())
    assert cpu_only["cuda"] is None


class _RunsCode:
    """Unpickling this object calls ``open(path, "w")``: code run by loading a checkpoint."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_and_the_code_does_not_run(tmp_path, comm):
    """The SHA-256 in meta.json proves integrity, not origin: a rank file planted together with
    its matching hash must not run code when it is loaded."""
    import hashlib

    _write(comm, tmp_path, 3)
    d, marker = tmp_path / "step_00000003", tmp_path / "code-ran"
    buf = io.BytesIO()
    torch.save({"model": {}, "optimizer": {}, "algorithm": _RunsCode(str(marker)), "rng": {}}, buf)
    evil = buf.getvalue()
    (d / "rank_000.pt").write_bytes(evil)
    meta = json.loads((d / "meta.json").read_text())
    meta["files"]["rank_000.pt"] = {"sha256": hashlib.sha256(evil).hexdigest(), "bytes": len(evil)}
    (d / "meta.json").write_text(json.dumps(meta))
    assert checkpoint.verify(d)["step"] == 3  # size and hash match: the driver would pick it
    m, o, a = _parts(5)
    with pytest.raises(BadInputError) as e:
        checkpoint.restore(str(d), 0, m, o, a)
    msg = str(e.value)
    assert "\n" not in msg and str(d / "rank_000.pt") in msg and "weights_only" not in msg, msg
    assert not marker.exists()  # the code did not run


def test_rank_files_hold_only_tensors_and_plain_data(tmp_path, comm):
    path = _write(comm, tmp_path, 2)
    st = torch.load(tmp_path / "step_00000002" / "rank_000.pt", weights_only=True)
    assert set(st) == {"model", "optimizer", "algorithm", "rng"}
    assert isinstance(st["rng"]["numpy"]["key"], torch.Tensor)
    assert isinstance(st["rng"]["python"]["state"], torch.Tensor)
    assert checkpoint.restore(path, 0, *_parts(3))["step"] == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_meta", "bad_meta", "missing_rank"])
def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, comm, damage, caplog):
    for s in (5, 10, 15):
        _write(comm, tmp_path, s, seed=s)
    newest = tmp_path / "step_00000015"
    f = newest / "rank_000.pt"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "flip":
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))
    elif damage == "no_meta":
        (newest / "meta.json").unlink()
    elif damage == "bad_meta":
        (newest / "meta.json").write_text('{"format": 2, "step": 15, "fil')
    else:
        f.unlink()
    with caplog.at_level(logging.WARNING):
        path, meta = checkpoint.newest_complete(tmp_path)
    assert path.name == "step_00000010" and meta["step"] == 10
    assert any("step_00000015" in r.getMessage() for r in caplog.records)
    m, o, a = _parts(99)
    checkpoint.restore(path, 0, m, o, a)
    assert a.v == 10


def test_keep_last_k_and_leftovers_of_a_crash_are_pruned(tmp_path, comm):
    (tmp_path / "step_00000001").mkdir()  # a write that crashed before its meta.json
    for s in (2, 4, 6, 8, 10):
        _write(comm, tmp_path, s, keep=2)
    assert [p.name for p in checkpoint.candidates(tmp_path)] == ["step_00000010", "step_00000008"]
    for s in (12, 14):
        _write(comm, tmp_path, s, keep=0)  # 0 keeps all
    assert len(checkpoint.candidates(tmp_path)) == 4


def test_a_write_interrupted_before_the_manifest_leaves_an_incomplete_checkpoint(tmp_path, comm):
    _write(comm, tmp_path, 3)

    class Broken:
        rank, world_size = 0, 1

        def stats_paused(self):
            return comm.stats_paused()

        def allgather_object(self, obj):
            raise RuntimeError("peer lost")

    with pytest.raises(RuntimeError):
        _write(Broken(), tmp_path, 6)
    assert (tmp_path / "step_00000006" / "rank_000.pt").is_file()
    assert not (tmp_path / "step_00000006" / "meta.json").exists()
    assert checkpoint.newest_complete(tmp_path)[0].name == "step_00000003"


def _tree(d) -> dict:
    """Every file under ``d`` with its bytes (what must survive a refused or partial clean-up)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _finished(comm, d, step, fp):
    """A checkpoint of a run that finished (the driver marks the last one after a successful run)."""
    path = _write(comm, d, step, fp=fp)
    checkpoint.mark_finished(path)
    return path


def test_where_a_run_starts_for_each_resume_setting(tmp_path, comm, caplog):
    cfg = TrainConfig(manifest="m.json", output=str(tmp_path / "out"))
    fp = checkpoint.fingerprint(cfg, 2)
    ck = tmp_path / "ck"
    _write(comm, ck, 7, fp=fp)
    assert restart.start_checkpoint(cfg.model_copy(update={"resume": True}), ck, fp).name == "step_00000007"
    assert restart.start_checkpoint(cfg.model_copy(update={"resume": "auto"}), ck, fp).name == "step_00000007"
    other = checkpoint.fingerprint(cfg.model_copy(update={"lr": 0.5}), 2)
    with pytest.raises(ConfigError, match="lr=0.5"):
        restart.start_checkpoint(cfg.model_copy(update={"resume": True, "lr": 0.5}), ck, other)
    assert (ck / "step_00000007").is_dir()  # a refused resume deletes nothing
    # auto with the unfinished checkpoint of another config: refused, nothing deleted
    with pytest.raises(ConfigError, match="step_00000007.*fresh_start=true"):
        restart.start_checkpoint(cfg.model_copy(update={"resume": "auto", "lr": 0.5}), ck, other)
    assert (ck / "step_00000007" / "meta.json").is_file()
    # a finished run's checkpoints: a fresh start says which checkpoint it deletes and how to resume it
    _finished(comm, ck, 9, fp)
    with caplog.at_level(logging.WARNING):
        assert restart.start_checkpoint(cfg.model_copy(update={"resume": "auto", "lr": 0.5}), ck, other) is None
    (line,) = [r.getMessage() for r in caplog.records if "starting fresh" in r.getMessage()]
    assert "step_00000009" in line and "resume=true" in line and "\n" not in line
    assert ck.is_dir() and _tree(ck) == {}  # the checkpoints went, the directory stays


def test_a_plain_rerun_does_not_delete_the_checkpoint_a_failed_run_can_resume_from(tmp_path, comm, caplog):
    """After a failure whose message says "it can resume from X", resume=false refuses with one
    line naming X and how to resume or start over; fresh_start=true deletes it, saying so first."""
    cfg = TrainConfig(manifest="m.json", output=str(tmp_path / "out"))
    fp = checkpoint.fingerprint(cfg, 2)
    ck = tmp_path / "ck"
    _write(comm, ck, 5, fp=fp)
    _write(comm, ck, 10, fp=fp)
    before = _tree(ck)
    with pytest.raises(ConfigError) as e:
        restart.start_checkpoint(cfg, ck, fp)
    msg = str(e.value)
    assert "\n" not in msg and "step_00000010" in msg and "resume=true" in msg and "fresh_start=true" in msg
    assert _tree(ck) == before
    with caplog.at_level(logging.WARNING):
        assert restart.start_checkpoint(cfg.model_copy(update={"fresh_start": True}), ck, fp) is None
    (line,) = [r.getMessage() for r in caplog.records if "starting fresh" in r.getMessage()]
    assert "step_00000010" in line and "resume=true" in line
    assert _tree(ck) == {}
    with pytest.raises(ConfigError, match="fresh_start"):
        TrainConfig(resume=True, fresh_start=True)


def _other_files(ck):
    """A shared directory: another run's checkpoints under its own folder, shards, a note."""
    c = make_communicator("local")
    try:
        _write(c, ck / "other-run", 5)
    finally:
        c.shutdown()
    (ck / "shards" / "worker_000").mkdir(parents=True)
    (ck / "shards" / "worker_000" / "part-00000.parquet").write_bytes(b"PAR1 not really")
    (ck / "notes.txt").write_text("mine")


@pytest.mark.parametrize("resume", [False, True, "auto"])
@pytest.mark.parametrize("where", ["top", "inside-a-step"])
def test_a_checkpoint_dir_holding_other_files_is_refused_before_anything_is_deleted(tmp_path, comm, resume, where):
    cfg = TrainConfig(manifest="m.json", output=str(tmp_path / "out"), resume=resume, fresh_start=resume is False)
    fp = checkpoint.fingerprint(cfg, 2)
    ck = tmp_path / "ck"
    _finished(comm, ck, 4, fp)
    if where == "top":
        _other_files(ck)
    else:
        (ck / "step_00000004" / "README").write_text("not a checkpoint file")
    before = _tree(ck)
    with pytest.raises(BadInputError) as e:
        restart.start_checkpoint(cfg, ck, fp)
    msg = str(e.value)
    assert "\n" not in msg and str(ck) in msg and "nothing was deleted" in msg
    assert ("notes.txt" in msg or "other-run" in msg or "shards" in msg) if where == "top" else "README" in msg
    assert _tree(ck) == before


def test_our_own_temporary_names_count_as_checkpoint_files(tmp_path, comm):
    cfg = TrainConfig(manifest="m.json", output=str(tmp_path / "out"))
    fp = checkpoint.fingerprint(cfg, 2)
    ck = tmp_path / "ck"
    _finished(comm, ck, 4, fp)
    (ck / "step_00000008").mkdir()
    (ck / "step_00000008" / ".rank_001.pt.tmp-4242").write_bytes(b"half")  # a write cut short
    (ck / "step_00000008" / "rank_000.pt").write_bytes(b"x")
    assert restart.start_checkpoint(cfg, ck, fp) is None
    assert _tree(ck) == {} and not (ck / "step_00000008").exists()


def test_pruning_and_clearing_delete_only_checkpoint_files(tmp_path, comm):
    for s in (2, 4, 6):
        _write(comm, tmp_path, s)
    (tmp_path / "step_00000002" / "keep-me.txt").write_text("a user's file")
    removed = checkpoint.prune(str(tmp_path), 1)
    assert [p.name for p in removed] == ["step_00000004", "step_00000002"]
    assert not (tmp_path / "step_00000004").exists()
    assert _tree(tmp_path / "step_00000002") == {"keep-me.txt": b"a user's file"}
    with pytest.raises(BadInputError, match="keep-me.txt"):
        checkpoint.clear(tmp_path)
    assert (tmp_path / "step_00000006" / "meta.json").is_file()


def test_the_relaunch_after_a_failure_deletes_nothing(tmp_path, comm):
    """A failed launch with no checkpoint of this config to resume from is relaunched from the
    start; the other files in the directory (another config's checkpoint, a note) stay."""
    cfg = TrainConfig(manifest="m.json", output=str(tmp_path / "out"), max_restarts=1)
    fp = checkpoint.fingerprint(cfg, 2)
    ck = tmp_path / "ck"
    _write(comm, ck, 3, fp={"seed": 99})
    before = _tree(ck)
    calls = []

    def launch(c, resume_from):
        calls.append(resume_from)
        if len(calls) == 1:
            raise RuntimeError("Connection reset by peer")
        return [{"ok": True}]

    results, restarts = restart.supervise(launch, cfg, ck, fp, None)
    assert calls == [None, None] and len(restarts) == 1 and restarts[0]["checkpoint"] is None
    assert _tree(ck) == before


# ---------------------------------------------------------------------------- checkpoints a run cannot verify
def _unverifiable(ck, step, damage):
    """A checkpoint whose meta.json this version cannot verify: unreadable, or of another format."""
    d = ck / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "rank_000.pt").write_bytes(b"weights of a run worth keeping")
    if damage == "unreadable":
        (d / "meta.json").write_text('{"format": 3, "step": %d, "fil' % step)
    else:
        (d / "meta.json").write_text(json.dumps({"format": 2, "step": step, "world": 1,
                                                 "files": {"rank_000.pt": {"sha256": "x", "bytes": 30}}}))
    return d


@pytest.mark.parametrize("damage", ["unreadable", "other_format"])
@pytest.mark.parametrize("with_finished", [False, True])
def test_a_plain_rerun_never_deletes_checkpoints_it_cannot_verify(tmp_path, comm, damage, with_finished):
    """Alone, or beside the checkpoints of a finished run (which a fresh start may delete): a plain
    rerun refuses in one line naming them, nothing deleted; fresh_start=true deletes them."""
    cfg = TrainConfig(manifest="m.json", output=str(tmp_path / "out"))
    fp = checkpoint.fingerprint(cfg, 1)
    ck = tmp_path / "ck"
    _unverifiable(ck, 3, damage)
    if with_finished:
        _finished(comm, ck, 9, fp)
    before = _tree(ck)
    auto = cfg.model_copy(update={"resume": "auto", "lr": 0.5})   # another config: it would start fresh
    for c in (cfg, auto) if with_finished else (cfg,):
        with pytest.raises(ConfigError) as e:
            restart.start_checkpoint(c, ck, checkpoint.fingerprint(c, 1))
        msg = str(e.value)
        assert "\n" not in msg and "step_00000003" in msg and "fresh_start=true" in msg, msg
        assert _tree(ck) == before
    if not with_finished:      # nothing to resume and nothing it would delete: auto starts fresh beside them
        assert restart.start_checkpoint(auto, ck, checkpoint.fingerprint(auto, 1)) is None
        assert _tree(ck) == before
    assert restart.start_checkpoint(cfg.model_copy(update={"fresh_start": True}), ck, fp) is None
    assert _tree(ck) == {}


def test_a_rerun_still_deletes_the_leftovers_of_a_write_cut_short(tmp_path, comm):
    """No meta.json at all: a checkpoint whose write was cut short (ours; nothing to resume from)."""
    cfg = TrainConfig(manifest="m.json", output=str(tmp_path / "out"))
    ck = tmp_path / "ck"
    (ck / "step_00000004").mkdir(parents=True)
    (ck / "step_00000004" / "rank_000.pt").write_bytes(b"half")
    assert restart.start_checkpoint(cfg, ck, checkpoint.fingerprint(cfg, 1)) is None
    assert _tree(ck) == {}


def test_pruning_keeps_checkpoints_it_cannot_verify(tmp_path, comm):
    _unverifiable(tmp_path, 1, "other_format")
    _unverifiable(tmp_path, 3, "unreadable")
    for s in (2, 4, 6, 8):
        _write(comm, tmp_path, s, keep=1)
    assert [p.name for p in checkpoint.candidates(tmp_path)] == ["step_00000008", "step_00000003", "step_00000001"]


# ---------------------------------------------------------------------------- "finished" only after the commit
def test_the_last_checkpoint_says_finished_only_after_the_output_commit(tmp_path, monkeypatch):
    """A commit that fails leaves the run's last checkpoint not finished, so a plain rerun keeps it
    (and says how to continue it); the commit that succeeds marks it finished."""
    import contextlib

    from pipeline.train import launch
    from train_fixtures import write_digit_shards

    man = write_digit_shards(tmp_path / "shards", workers=1, n_train=64, n_test=32, n_val=32, row_group_rows=32)
    cfg = TrainConfig(manifest=str(man), output=str(tmp_path / "out"), launcher="local", epochs=1, batch_size=16,
                      optimizer="sgd", lr=0.05, progress=False, max_restarts=0)
    ck = tmp_path / "out-checkpoints"
    real = launch.output_job

    @contextlib.contextmanager
    def failing_commit(final, **kw):
        with real(final, **kw) as job:
            yield job
            raise OSError(28, "No space left on device", str(final))   # the commit fails

    monkeypatch.setattr(launch, "output_job", failing_commit)
    with pytest.raises(OSError, match="No space left"):
        launch.train(cfg)
    (last,) = checkpoint.candidates(ck)
    meta = checkpoint.verify(last)
    assert not checkpoint.finished(meta) and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="did not finish"):       # a plain rerun does not delete it
        restart.start_checkpoint(cfg, ck, checkpoint.fingerprint(cfg, 1))
    monkeypatch.setattr(launch, "output_job", real)
    s = launch.train(cfg.model_copy(update={"resume": True}))
    assert s["resumed_from"].endswith(last.name) and (tmp_path / "out" / "summary.json").is_file()
    assert checkpoint.finished(checkpoint.verify(checkpoint.candidates(ck)[0]))
