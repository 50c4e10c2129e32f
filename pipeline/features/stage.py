"""The feature stage on Spark (``jobs/features.py``): Delphes events -> ``hlf/``, ``llf/``,
``scaling.json``, ``report.json`` (docs/hep-features.md).

Input, either of:

* an ingested dataset (``jobs/ingest_root.py`` output, recognised by its ``_report.json``): each
  Parquet part is one work unit, and the report says which ROOT file and entry range it holds,
  which is what the labels and the per-file counts need; or
* ROOT files (paths/globs, or no ``input`` at all: the files of ``samples``), cut into
  entry-range chunks exactly as the ingestion does (``step_size``) and read with uproot in the
  tasks. The driver never opens them: like the ingestion, the tasks plan the files.

The modules, in the order the data takes: :mod:`~pipeline.features.config` (the settings),
:mod:`~pipeline.features.plan` (files, labels, work units, tasks), :mod:`~pipeline.features.tasks`
(the feature pass), :mod:`~pipeline.features.workfiles` (the selected events between the
passes), :mod:`~pipeline.features.split` (split and balancing), :mod:`~pipeline.features.rows`
and :mod:`~pipeline.features.writers` (the Parquet datasets), :mod:`~pipeline.features.report`.

Flow: the feature pass (one Spark job, two when a ROOT file is larger than one chunk) leaves the
selected events in work files and returns one status row per chunk; the driver decides the
sample_ids, the split, the balancing and the scaling from the statuses, writes ``hlf/``; a
second Spark pass writes ``llf/`` from the work files.

Bad files (unreadable, no tree, missing branch, no sample label, a chunk failing) are listed
in ``report.json`` and logged one line each; the good files are written; then the stage raises
BadInputError unless ``allow_bad_files``.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np

from ..errors import BadInputError
from ..ingest.root import Chunk
from . import delphes as D
from .config import FeaturesConfig, SampleSpec
from .layout import HLF_NAMES, LLF_NAMES, N_CLASSES, N_HLF, N_LLF_FEATURES
from .plan import plan_units
from .report import Tally, finish, per_file, tally
from .rows import SCHEMA_VERSIONS, llf_row_bytes
from .split import SPLITS, Assignment, assign
from .tasks import N_STATS, run_units
from .workfiles import work_name
from .writers import llf_groups, write_hlf, write_llf

__all__ = ["FeaturesConfig", "SampleSpec", "build_features", "plan_features"]
log = logging.getLogger(__name__)


def plan_features(cfg: FeaturesConfig) -> dict:
    """--dry-run: inputs and outputs (Spark is not started)."""
    from ..fs import location

    out = location(cfg.output, output=True)
    raw = cfg.input if cfg.input is not None else [f for s in cfg.samples for f in s.files]
    return {"inputs": raw, "samples": [s.model_dump() for s in cfg.samples],
            "required_branches": list(D.REQUIRED_BRANCHES),
            "outputs": {"hlf": str(out.child("hlf")), "llf": str(out.child("llf")),
                        "scaling": str(out.child("scaling.json")), "report": str(out.child("report.json"))}}


def _selected(units: list[Chunk], labels: dict, st: dict, t: Tally):
    """Every selected event's label, HLF and LLF moments, in sample_id order, from the statuses."""
    done = [u for u in units if u.chunk_id in t.offsets]
    return (np.repeat(np.array([labels[u.file_index] for u in done], np.int64),
                      [int(st[u.chunk_id]["n_selected"]) for u in done]),
            np.concatenate([st[u.chunk_id]["hlf"] for u in done]) if done else np.zeros((0, N_HLF), np.float32),
            np.concatenate([st[u.chunk_id]["stats"] for u in done]) if done else np.zeros((0, N_STATS)))


def _written_counts(units: list[Chunk], st: dict, t: Tally, asg: Assignment) -> tuple[dict, dict]:
    """({file_index: events written}, {split: events written})."""
    per_file_: dict = {}
    for u in units:
        if u.chunk_id in t.offsets:
            o = t.offsets[u.chunk_id]
            n = int(st[u.chunk_id]["n_selected"])
            per_file_[u.file_index] = per_file_.get(u.file_index, 0) + int(asg.keep[o:o + n].sum())
    per_split = np.bincount(asg.split[asg.keep].astype(np.int64), minlength=len(SPLITS))
    return per_file_, {s: int(per_split[i]) for i, s in enumerate(SPLITS)}


def _scaling(hlf: np.ndarray, stats: np.ndarray, asg: Assignment):
    """The scaling model of the written train events, from the tasks' per-event partial moments."""
    from .scaling import scaling_from_events

    train = (asg.split == SPLITS.index("train")) & asg.keep
    x = stats[train]
    return scaling_from_events(hlf[train], x[:, 0], x[:, 1:1 + N_LLF_FEATURES], x[:, 1 + N_LLF_FEATURES:])


def _llf_chunks(units: list[Chunk], st: dict, t: Tally, codes: np.ndarray, labels: dict) -> list[tuple]:
    """Per chunk with selected events: (work file, first sample_id, label, codes, kept llf bytes)."""
    out = []
    for u in units:
        n = int(st[u.chunk_id]["n_selected"]) if u.chunk_id in t.offsets else 0
        if n:
            o = t.offsets[u.chunk_id]
            c = codes[o:o + n]
            out.append((work_name(u.file_index, u.entry_start), o, int(labels[u.file_index]), c,
                        int(llf_row_bytes(st[u.chunk_id]["stats"][:, 0])[c >= 0].sum())))
    return out


def build_features(cfg: FeaturesConfig, spark=None) -> dict:
    """Run the stage; returns {"files": [...per-file counts...], "hlf": path, "llf": path,
    "scaling": path, "report": path, "splits": {...}}. See the module docstring."""
    from ..fs import check_writable, location
    from ..outputs import atomic_output_dir, check_staging, write_json
    from ..schemas import SCHEMA_DIR, load_schema, validate_parquet
    from ..spark import get_spark

    t_start = time.time()
    schema_dir = Path(cfg.schema_dir) if cfg.schema_dir else SCHEMA_DIR
    for name in ("hlf", "llf"):       # a missing or broken schema fails before any work
        load_schema(name, SCHEMA_VERSIONS[name], schema_dir)
    files, units, labels, notes = plan_units(cfg)
    for n in notes:
        log.info("%s", n)
    if not [f for f in files if not f.error]:
        first = files[0] if files else None
        raise BadInputError(f"no input file could be used; {first.path}: {first.error}" if first
                            else "no input files")
    out = location(cfg.output, output=True)  # a local path or s3:// (staged on the driver's disk)
    check_writable(out)
    spark = spark or get_spark(cfg.spark)
    check_staging(spark.sparkContext.master, out, "feature")
    log.info("features: %d work unit(s) from %d file(s) -> Spark tasks", len(units), len(files))
    with atomic_output_dir(out) as tmp:
        work = tmp / "_work"    # the selected events between the Spark passes (removed before commit)
        work.mkdir()
        units, st = run_units(spark, files, units, work, cfg, t_start)
        if not [f for f in files if not f.error]:    # nothing to write: no output at all
            first = files[0]
            raise BadInputError(f"no input file could be used; {first.path}: {first.error}")
        t = tally(files, units, labels, st)
        sel_labels, sel_hlf, sel_stats = _selected(units, labels, st, t)
        asg = assign(sel_labels, list(t.per_label), cfg.seed, cfg.test_fraction, cfg.val_fraction,
                     cfg.balance_classes)
        counts, n_written = asg.counts, int(asg.keep.sum())
        wr, split_counts = _written_counts(units, st, t, asg)
        wr_file = {f.file_index: wr.get(f.file_index, 0) for f in files}
        model = _scaling(sel_hlf, sel_stats, asg)
        model.save(tmp / "scaling.json")
        log.info("features: split%s and scaling (%d train events) done (%.1f s)",
                 " and balancing" if cfg.balance_classes else "", model.hlf_count, time.time() - t_start)
        codes = np.where(asg.keep, asg.split, -1).astype(np.int8)
        write_hlf(tmp / "hlf", sel_labels, sel_hlf, codes, cfg.file_mb, cfg.hlf_row_group_mb)
        groups = llf_groups(_llf_chunks(units, st, t, codes, labels), cfg.file_mb,
                            spark.sparkContext.defaultParallelism)
        write_llf(spark, tmp / "llf", work, groups, cfg.llf_row_group_mb)
        shutil.rmtree(work)
        # the schema from the Parquet footers; the values' constraints (no nulls, list lengths) hold
        # by construction: every row comes from numpy blocks of fixed width or of 19 x n_particles
        for name in ("hlf", "llf"):
            validate_parquet(tmp / name, load_schema(name, SCHEMA_VERSIONS[name], schema_dir), check_data=False)
        log.info("features: hlf/ and llf/ written (%d LLF file(s)) (%.1f s)", len(groups), time.time() - t_start)
        files_rep = per_file(files, labels, t, wr_file)
        report = {"job": "features", "files": files_rep,
                  "bad_files": [{"file": p["file"], "reason": p["error"]} for p in files_rep if p["error"]],
                  "notes": notes, "splits": split_counts,
                  "classes": {str(lab): {s: counts[(s, lab)] for s in SPLITS} for lab in range(N_CLASSES)},
                  "seed": cfg.seed, "balance_classes": cfg.balance_classes,
                  "hlf": str(out.child("hlf")), "llf": str(out.child("llf")),
                  "scaling": str(out.child("scaling.json")), "report": str(out.child("report.json")),
                  "hlf_names": list(HLF_NAMES), "llf_names": list(LLF_NAMES),
                  "seconds": round(time.time() - t_start, 3)}
        write_json(tmp / "report.json", report)
    finish(report, out, len(files), n_written, split_counts, cfg.allow_bad_files)
    return report
