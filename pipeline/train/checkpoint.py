"""Checkpoints: every K steps and at the end; a resume continues from the newest complete one.

Layout: one directory per checkpoint, one file per rank, and a manifest written last::

    <checkpoint_dir>/step_<NNNNNNNN>/rank_<RRR>.pt   {"model", "optimizer", "algorithm", "rng"}
    <checkpoint_dir>/step_<NNNNNNNN>/meta.json       {"format", "step", "world", "elapsed_s", "fingerprint",
                                                      "metrics": [metric lines so far],
                                                      "files": {"rank_000.pt": {"sha256", "bytes"}, ...}}

Every rank writes its OWN state (to a temporary name, fsync'd, then renamed into place), so
no rank ever holds another rank's state; the ranks then exchange only (file, hash, size) and
rank 0 writes ``meta.json`` the same way. A checkpoint is complete when its ``meta.json``
exists and every rank file has the recorded size and SHA-256: a crash at any moment leaves
either a complete checkpoint or one that :func:`newest_complete` skips with a warning naming
it (the previous complete one is used). Rank 0 keeps the newest ``keep`` complete checkpoints.

``checkpoint_dir`` may be an ``s3://bucket/prefix`` on an S3-compatible object store
(:mod:`pipeline.fs`): every rank PUTs its own ``rank_<RRR>.pt`` (one object, visible whole or not
at all) and rank 0 PUTs ``meta.json`` last, so ``meta.json`` is the checkpoint's completion marker
there as well; checkpoints are found by listing the prefix, and the same size/SHA-256 check
applies to every rank object before a checkpoint is used. Local directories keep the temporary
file, ``fsync`` and rename.

``rng`` holds torch's CPU generator, every CUDA device's generator (when CUDA is present),
numpy's global and Python's ``random`` states. Every piece of state is a tensor or plain data
(numbers, strings, lists, dicts), and rank files are loaded with ``torch.load(...,
weights_only=True)``: the SHA-256 in ``meta.json`` proves a file is whole, not who wrote it, so a
rank file whose pickle names any other Python object is refused (one line) and nothing in it runs.
Resuming rebuilds each rank's model, optimizer, algorithm and RNG state and the training loop
continues at step ``step`` (epoch ``step // steps_per_epoch``, reopened with the same (worker,
epoch) seed, skipping the batches already taken), so a deterministic run resumed from a
checkpoint ends with the same parameters as one that was never interrupted. The fingerprint (the
config fields that change the result) must match, else ConfigError.

What a run may delete: only checkpoint files (:func:`remove`, :func:`clear`): rank files,
``meta.json`` and their temporary names inside ``step_NNNNNNNN/``; a checkpoint directory holding
anything else is refused before anything is deleted (:func:`check_own`). A checkpoint whose
``meta.json`` is there but cannot be verified (unreadable, another format version:
:func:`meta_problem`) is never pruned, and a fresh start refuses it in one line
(:func:`check_verifiable`) unless ``fresh_start`` is set. The driver marks the last checkpoint of
a run as finished (:func:`mark_finished`) once the run's output is committed, so a later fresh
start can tell the checkpoints of a finished run from those a failed run can resume from.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
from typing import Any, Callable, Optional

import numpy as np

from ..errors import BadInputError, ConfigError
from ..fs import (Location, delete_file, file_size, list_dirs, list_entries, list_files, location,
                  read_bytes_if_exists, remove_dir_if_empty, sha256, sync_dir, write_bytes)

log = logging.getLogger(__name__)

FORMAT = 3  # 3: RNG states as tensors and plain data (rank files load with weights_only=True)
META = "meta.json"
_STEP_DIR = re.compile(r"step_(\d{8})")
#: the files a checkpoint directory holds: rank files, meta.json, and their temporary names while
#: being written (``fs.write_bytes``: ``.<name>.tmp-<pid>``); nothing else is ever deleted
_OWN_FILE = re.compile(r"(?:rank_\d{3,}\.pt|meta\.json)|\.(?:rank_\d{3,}\.pt|meta\.json)\.tmp-\d+")
FINGERPRINT_FIELDS = ("model", "epochs", "batch_size", "optimizer", "lr", "momentum", "nesterov", "weight_decay",
                      "lr_scaling", "warmup_epochs", "algorithm", "policy", "seed", "shuffle_buffer", "max_steps",
                      "loader",  # the loader mode can change the batch order
                      "batch_rule", "lars_eta", "init", "warmup_optimizer", "warmup_lr", "lr_decay_at",
                      "lr_decay_factor", "augment")


class CorruptCheckpoint(Exception):
    """A checkpoint directory that is incomplete, truncated or does not match its hashes."""


def fingerprint(cfg, workers: int) -> dict:
    d = cfg.model_dump(mode="json", include=set(FINGERPRINT_FIELDS))
    d["workers"] = workers
    return d


def location_of(path: str | os.PathLike | Location) -> Location:
    """A checkpoint path (local or ``s3://``) as a :class:`~pipeline.fs.Location`: every operation
    below goes through :mod:`pipeline.fs`, the same for both."""
    return location(path, output=True)


def step_dir(ckpt_dir: str | os.PathLike | Location, step: int) -> Location:
    return location_of(ckpt_dir).child(f"step_{step:08d}")


def rank_file(rank: int) -> str:
    return f"rank_{rank:03d}.pt"


# ---------------------------------------------------------------------------- RNG states
def _torch_cuda():
    import torch

    return torch.cuda


def rng_state(cuda=None) -> dict:
    """Torch CPU, CUDA (every device, when available), numpy and Python RNG states, as tensors and
    plain data (a rank file loads with ``torch.load(..., weights_only=True)``). ``cuda`` is the
    probe (``torch.cuda`` by default; tests inject one)."""
    import torch

    cuda = cuda if cuda is not None else _torch_cuda()
    name, key, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(), "cuda": list(cuda.get_rng_state_all()) if cuda.is_available() else None,
            "numpy": {"bit_generator": str(name), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
            "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64),
                       "gauss_next": gauss_next}}


def set_rng_state(st: dict, cuda=None) -> None:
    import torch

    cuda = cuda if cuda is not None else _torch_cuda()
    torch.set_rng_state(st["torch"].cpu())
    n, py = st.get("numpy"), st.get("python")
    if n is not None:
        np.random.set_state((n["bit_generator"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    if py is not None:
        random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    saved = st.get("cuda")
    if saved and cuda.is_available():
        have = cuda.device_count()
        if have != len(saved):
            log.warning("checkpoint holds CUDA RNG states of %d device(s), this worker sees %d: restoring %d",
                        len(saved), have, min(have, len(saved)))
        cuda.set_rng_state_all([s.cpu() for s in saved[:have]])


# ---------------------------------------------------------------------------- writing
def save_torch(path: str | os.PathLike | Location, obj: Any) -> Location:
    """``torch.save`` to memory, then an atomic write: a full or read-only disk raises an
    OSError naming the file (``torch.save`` to a path fails with an internal message)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    loc = location(path, output=True)   # a local path or an object-store URI (not through Path: s3:// -> s3:/)
    try:
        write_bytes(loc, buf.getvalue())
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(loc)) from None
    return loc


def rank_bytes(model, optimizer, algo, cuda=None) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "algorithm": algo.state_dict(),
                "rng": rng_state(cuda)}, buf)
    return buf.getvalue()


def write(comm, ckpt_dir: str, step: int, model, optimizer, algo, meta: dict[str, Any],
          keep: int = 0) -> Optional[str]:
    """Collective: every rank writes its own file; rank 0 then writes ``meta.json`` (``meta`` on
    rank 0: ``elapsed_s``, ``fingerprint``, ``metrics``) and prunes to the newest ``keep``.
    Returns the checkpoint directory on rank 0, None on the other ranks."""
    d = step_dir(ckpt_dir, step)
    blob = rank_bytes(model, optimizer, algo)
    write_bytes(d.child(rank_file(comm.rank)), blob)
    entry = (rank_file(comm.rank), hashlib.sha256(blob).hexdigest(), len(blob))
    del blob
    with comm.stats_paused():
        entries = comm.allgather_object(entry)
    if comm.rank != 0:
        return None
    full = {"format": FORMAT, "step": int(step), "world": comm.world_size, **meta,
            "files": {name: {"sha256": sha, "bytes": n} for name, sha, n in entries}}
    write_bytes(d.child(META), (json.dumps(full, default=str) + "\n").encode())
    sync_dir(d)
    if keep:
        prune(ckpt_dir, keep)
    return str(d)


def prune(ckpt_dir: str, keep: int) -> list[Location]:
    """Remove all but the newest ``keep`` complete checkpoints, and incomplete ones older than
    the newest complete one (leftovers of a crash). Returns what was removed."""
    removed, complete = [], 0
    d = location_of(ckpt_dir)
    metas = {f.path for f in list_files(d) if f.name == META}
    for p in candidates(d):
        ok = p.child(META).path in metas
        if ok and meta_problem(p):
            continue         # one this version cannot verify: never deleted by a run (start_checkpoint)
        if ok:
            complete += 1
        if (ok and complete > keep) or (not ok and complete > 0):
            remove(p)
            removed.append(p)
    return removed


def remove(path: str | os.PathLike | Location) -> None:
    """Remove ONE checkpoint (a ``step_NNNNNNNN`` directory): only the files a checkpoint holds
    (rank files, ``meta.json``, their temporary names); the directory goes when nothing else is
    left in it. Missing is fine."""
    d = location_of(path)
    if not _STEP_DIR.fullmatch(d.name):
        raise ValueError(f"{d} is not a checkpoint directory (step_NNNNNNNN)")
    for f, is_dir in list_entries(d):
        if not is_dir and _OWN_FILE.fullmatch(f.name):
            delete_file(f)
    remove_dir_if_empty(d)


def foreign(ckpt_dir: str | os.PathLike | Location) -> list[Location]:
    """What ``ckpt_dir`` holds besides checkpoints: any entry directly under it other than a
    ``step_NNNNNNNN`` directory, and any entry of such a directory other than a checkpoint file."""
    out = []
    for p, is_dir in list_entries(location_of(ckpt_dir)):
        if not (is_dir and _STEP_DIR.fullmatch(p.name)):
            out.append(p)
            continue
        out += [f for f, sub in list_entries(p) if sub or not _OWN_FILE.fullmatch(f.name)]
    return out


def check_own(ckpt_dir: str | os.PathLike | Location) -> None:
    """BadInputError naming ``ckpt_dir`` and what else it holds, unless it holds only checkpoints
    (or does not exist): a run never deletes, or writes among, files it does not recognise."""
    d = location_of(ckpt_dir)
    other = foreign(d)
    if other:
        first = other[0].path[len(d.path.rstrip("/")) + 1:]
        raise BadInputError(f"checkpoint_dir {d} holds {len(other)} entr{'y' if len(other) == 1 else 'ies'} that "
                            f"{'is' if len(other) == 1 else 'are'} not checkpoints (first: {first}); nothing was "
                            "deleted; give the checkpoints a directory of their own (checkpoint_dir=...)")


def clear(ckpt_dir: str | os.PathLike | Location) -> list[Location]:
    """Remove every checkpoint in ``ckpt_dir`` after :func:`check_own` (which refuses a directory
    holding anything else, before anything is deleted); the directory itself stays. Returns the
    checkpoints removed."""
    d = location_of(ckpt_dir)
    check_own(d)
    gone = candidates(d)
    for p in gone:
        remove(p)
    return gone


def meta_problem(path: str | os.PathLike | Location) -> Optional[str]:
    """Why this checkpoint's ``meta.json`` cannot be verified (unreadable, not JSON, another format
    version, inconsistent), or None: readable and of this version, or absent (a write cut short
    before its manifest: ours, nothing to resume from). Only the meta is read."""
    p = location_of(path)
    try:
        raw = read_bytes_if_exists(p.child(META))
    except (OSError, BadInputError) as e:
        return f"unreadable meta.json ({e})"
    if raw is None:
        return None
    try:
        _parse_meta(raw)
    except CorruptCheckpoint as e:
        return str(e)
    return None


def unverifiable(ckpt_dir: str | os.PathLike | Location) -> list[tuple[Location, str]]:
    """(checkpoint, reason) of every checkpoint in ``ckpt_dir`` whose meta cannot be verified
    (:func:`meta_problem`), newest first."""
    return [(p, why) for p in candidates(ckpt_dir) if (why := meta_problem(p))]


def check_verifiable(ckpt_dir: str | os.PathLike | Location, hint: str) -> None:
    """ConfigError in one line naming the checkpoints of ``ckpt_dir`` that cannot be verified (a
    checkpoint of another version of the pipeline, or a damaged meta.json), unless there are none:
    a run about to clear ``ckpt_dir`` never deletes them unless told to (``hint``)."""
    bad = unverifiable(ckpt_dir)
    if bad:
        named = "; ".join(f"{p.name}: {why}" for p, why in bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3
                                                                         else "")
        raise ConfigError(f"checkpoint_dir {location_of(ckpt_dir)} holds {len(bad)} checkpoint(s) this run cannot "
                          f"verify ({named}); nothing was deleted: move them elsewhere, or delete them and start "
                          f"over with {hint}")


def mark_finished(path: str | os.PathLike | Location) -> None:
    """Record in the checkpoint's ``meta.json`` that its run finished (the driver calls this after a
    successful run): a later fresh start may delete it, while the checkpoints of a run that did
    not finish are kept unless resume or ``fresh_start`` says what to do with them."""
    p = location_of(path)
    meta = json.loads(read_bytes_if_exists(p.child(META)) or b"null")
    if isinstance(meta, dict) and not meta.get("finished"):
        write_bytes(p.child(META), (json.dumps({**meta, "finished": True}, default=str) + "\n").encode())


def finished(meta: dict) -> bool:
    """Whether the run that wrote this checkpoint (its meta) finished (:func:`mark_finished`)."""
    return bool(meta.get("finished"))


# ---------------------------------------------------------------------------- reading
def candidates(ckpt_dir: str | os.PathLike | Location) -> list[Location]:
    """Checkpoint directories, newest first (on an object store: the step prefixes the listing shows)."""
    return sorted((p for p in list_dirs(location_of(ckpt_dir)) if _STEP_DIR.fullmatch(p.name)), key=lambda p: p.name,
                  reverse=True)


def verify(path: str | os.PathLike | Location) -> dict:
    """The meta of a complete checkpoint; CorruptCheckpoint naming what is wrong otherwise."""
    p = location_of(path)
    try:
        raw = read_bytes_if_exists(p.child(META))
    except (OSError, BadInputError) as e:
        raise CorruptCheckpoint(f"unreadable meta.json ({e})") from None
    if raw is None:
        raise CorruptCheckpoint("incomplete (no meta.json)")
    meta = _parse_meta(raw)
    for name, info in sorted(meta["files"].items()):
        f = p.child(name)
        size = file_size(f)
        if size is None:
            raise CorruptCheckpoint(f"{name} missing")
        if size != info.get("bytes"):
            raise CorruptCheckpoint(f"{name} has {size} bytes, expected {info.get('bytes')} (truncated?)")
        if sha256(f) != info.get("sha256"):
            raise CorruptCheckpoint(f"{name} does not match its SHA-256 (corrupt)")
    return meta


def _parse_meta(raw: bytes) -> dict:
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpoint(f"unreadable meta.json ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CorruptCheckpoint("meta.json is not a checkpoint manifest of this version")
    if len(meta["files"]) != meta.get("world"):
        raise CorruptCheckpoint(f"meta.json lists {len(meta['files'])} rank files for {meta.get('world')} ranks")
    return meta


def newest_complete(ckpt_dir: str | os.PathLike | Location,
                    warn: Callable[[str], None] = log.warning) -> Optional[tuple[Location, dict]]:
    """(path, meta) of the newest complete checkpoint; corrupt or incomplete newer ones are
    skipped with a warning naming them. None when there is none."""
    for p in candidates(ckpt_dir):
        try:
            return p, verify(p)
        except CorruptCheckpoint as e:
            warn(f"skipping checkpoint {p}: {e}; trying the previous one")
    return None


def check_fingerprint(path: str | os.PathLike, meta: dict, expected: dict) -> None:
    fp = meta.get("fingerprint") or {}
    for k, v in expected.items():
        if fp.get(k) != v:
            raise ConfigError(f"cannot resume from {path}: config value {k}={v!r} differs from the "
                              f"checkpoint's {fp.get(k)!r}")


def matches(meta: dict, expected: dict) -> bool:
    fp = meta.get("fingerprint") or {}
    return all(fp.get(k) == v for k, v in expected.items())


def restore(path: str | os.PathLike, rank: int, model, optimizer, algo, device=None, cuda=None) -> dict:
    """Load rank ``rank``'s state of checkpoint ``path`` (checked against its hash) into the
    model/optimizer/algorithm, restore the RNG states; return the meta (``step``,
    ``elapsed_s``, ``metrics``, ``fingerprint``)."""
    import torch

    p = location_of(path)
    meta = json.loads(read_bytes_if_exists(p.child(META)) or b"null") or {}
    name = rank_file(rank)
    info = (meta.get("files") or {}).get(name)
    if info is None:
        raise CorruptCheckpoint(f"{p}: no state for rank {rank}")
    data = read_bytes_if_exists(p.child(name)) or b""
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CorruptCheckpoint(f"{p.child(name)} does not match its SHA-256")
    try:
        st = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise BadInputError(f"{p.child(name)}: refused: it holds Python objects other than tensors and plain data, "
                            "which could run code when loaded; this pipeline's checkpoints hold none") from None
    del data
    model.load_state_dict(st["model"])
    optimizer.load_state_dict(st["optimizer"])
    algo.load_state_dict(st["algorithm"])
    set_rng_state(st["rng"], cuda)
    return meta
