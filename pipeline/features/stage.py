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
passes), :mod:`~pipeline.features.split` (the split rule) and
:mod:`~pipeline.features.thresholds` (its thresholds), :mod:`~pipeline.features.rows` and
:mod:`~pipeline.features.writers` (the Parquet datasets), :mod:`~pipeline.features.report`.

The driver handles per-file and per-chunk metadata, counts and histograms, never per-event
arrays:

1. the feature pass (one Spark job, two when a ROOT file is larger than one chunk) leaves each
   chunk's selected events in a work file and returns one status row per chunk (counts, error,
   bytes);
2. the driver numbers the events (``sample_id``: the chunks' contiguous ranges in (file, entry)
   order, from the counts) and chooses the split and balancing thresholds from the tasks'
   histograms of the events' seeded keys (small Spark jobs that hash sample_id ranges, no data
   read);
3. the writer pass applies the rule to every event of the work files and writes ``llf/`` and
   ``hlf/``; its tasks return the rows per chunk and split and the moments of the train rows, from
   which the driver checks the counts and fits ``scaling.json``.

Bad files (unreadable, no tree, missing branch, no sample label, a chunk failing) are listed
in ``report.json`` and logged one line each; the good files are written; then the stage raises
BadInputError unless ``allow_bad_files``.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from ..commit import output_job
from ..tables.tables_job import tables_job
from ..errors import BadInputError
from ..fs import check_writable, location
from ..ingest.root import Chunk
from ..inputs import parquet_schema_of
from ..spark import default_parallelism, forward_s3_settings, get_spark
from . import delphes as D
from .config import FeaturesConfig, SampleSpec
from .layout import HLF_NAMES, LLF_NAMES, N_CLASSES, N_HLF, N_LLF_FEATURES
from .plan import plan_units
from .report import Tally, finish, per_file, tally
from .rows import SCHEMA_VERSIONS
from .scaling import Moments, model_of
from .split import SPLITS
from .tasks import run_units
from .thresholds import choose_rule
from .workfiles import work_name
from .writers import Written, llf_groups, part_name, write_datasets, write_empty

__all__ = ["FeaturesConfig", "SampleSpec", "build_features", "plan_features"]
log = logging.getLogger(__name__)


def plan_features(cfg: FeaturesConfig) -> dict:
    """--dry-run: inputs and outputs (Spark is not started)."""
    out = location(cfg.output, output=True)
    raw = cfg.input if cfg.input is not None else [f for s in cfg.samples for f in s.files]
    return {"inputs": raw, "samples": [s.model_dump() for s in cfg.samples],
            "required_branches": list(D.REQUIRED_BRANCHES),
            "outputs": {"hlf": str(out.child("hlf")), "llf": str(out.child("llf")),
                        "scaling": str(out.child("scaling.json")), "report": str(out.child("report.json"))}}


def _ranges(units: list[Chunk], st: dict, t: Tally, labels: dict) -> list[tuple[int, int, int]]:
    """The selected events as (first sample_id, stop, label) ranges: one per chunk, merged where
    consecutive chunks share a label."""
    out: list = []
    for u in units:
        n = int(st[u.chunk_id]["n_selected"]) if u.chunk_id in t.offsets else 0
        if not n:
            continue
        a, lab = t.offsets[u.chunk_id], int(labels[u.file_index])
        if out and out[-1][1] == a and out[-1][2] == lab:
            out[-1] = (out[-1][0], a + n, lab)
        else:
            out.append((a, a + n, lab))
    return out


def _groups(units: list[Chunk], st: dict, t: Tally, labels: dict, counts: dict, cfg: FeaturesConfig,
            slots: int) -> tuple[list[tuple], list[int], list[Chunk]]:
    """The writer tasks' groups (group, work files, their attempts, first sample_ids, labels, chunk
    indices), their
    expected llf/ bytes (each chunk's selected bytes times its class's kept fraction) and the
    chunks with selected events."""
    done = [u for u in units if u.chunk_id in t.offsets and int(st[u.chunk_id]["n_selected"])]
    kept = {lab: sum(counts[(s, lab)] for s in SPLITS) / n for lab, n in t.per_label.items() if n}
    sizes = [int(st[u.chunk_id]["llf_bytes"] * kept[labels[u.file_index]]) for u in done]
    groups, packed = [], llf_groups(sizes, cfg.file_mb, slots)
    for g, idx in enumerate(packed):
        us = [done[i] for i in idx]
        groups.append((g, [work_name(u.file_index, u.entry_start) for u in us],
                       [st[u.chunk_id]["attempt_dir"] for u in us], [t.offsets[u.chunk_id] for u in us],
                       [int(labels[u.file_index]) for u in us], [u.chunk_id for u in us]))
    return groups, [sum(sizes[i] for i in idx) for idx in packed], done


def _check_written(w: Written, groups: list[tuple], st: dict, done: list[Chunk], counts: dict,
                   labels: dict) -> None:
    """Every chunk's work file read whole, every group's file written, the rows per class and split
    those of the rule: a work file lost or cut short, or a task that wrote too little, fails the
    stage with one line."""
    for u in done:
        rows = w.chunks.get(u.chunk_id, (None, None))[0]
        if rows != int(st[u.chunk_id]["n_selected"]):
            raise RuntimeError(f"work file {work_name(u.file_index, u.entry_start)}: {rows} events read back, "
                               f"{st[u.chunk_id]['n_selected']} selected")
    missing = {f"llf/{part_name(g[0])}" for g in groups} - set(w.files)
    if missing:
        raise RuntimeError(f"{sorted(missing)[0]}: not written by the writer tasks")
    got: dict = {}
    for u in done:
        for s, n in zip(SPLITS, w.chunks[u.chunk_id][1]):
            got[(s, labels[u.file_index])] = got.get((s, labels[u.file_index]), 0) + n
    for key, n in counts.items():
        if got.get(key, 0) != n:
            raise RuntimeError(f"features: {got.get(key, 0)} {key[0]} events of class {key[1]} written, the "
                               f"split has {n}")


def _report(cfg: FeaturesConfig, files, labels: dict, t: Tally, done: list[Chunk], written: dict, counts: dict,
            notes: list[str], out) -> dict:
    """``report.json`` (less the timings)."""
    wr_file = {f.file_index: 0 for f in files}
    for u in done:
        wr_file[u.file_index] += sum(written[u.chunk_id][1])
    files_rep = per_file(files, labels, t, wr_file)
    return {"job": "features", "files": files_rep,
            "bad_files": [{"file": p["file"], "reason": p["error"]} for p in files_rep if p["error"]],
            "notes": notes, "splits": {s: sum(counts[(s, lab)] for lab in t.per_label) for s in SPLITS},
            "classes": {str(lab): {s: counts[(s, lab)] for s in SPLITS} for lab in range(N_CLASSES)},
            "seed": cfg.seed, "balance_classes": cfg.balance_classes,
            "hlf": str(out.child("hlf")), "llf": str(out.child("llf")),
            "scaling": str(out.child("scaling.json")), "report": str(out.child("report.json")),
            "hlf_names": list(HLF_NAMES), "llf_names": list(LLF_NAMES)}


def _validate(job, schema_dir: Path) -> None:
    """The schema of every hlf/ and llf/ file from its footer; the values' constraints (no nulls,
    list lengths) hold by construction: every row comes from numpy blocks of fixed width or of
    19 x n_particles."""
    from ..schemas import load_schema, validate

    expected = {name: load_schema(name, SCHEMA_VERSIONS[name], schema_dir) for name in ("hlf", "llf")}
    for rel, loc in sorted(job.kept().items()):
        name = rel.split("/", 1)[0]
        if name in expected:
            validate(parquet_schema_of(loc), expected[name], str(job.final.child(rel)))


def build_features(cfg: FeaturesConfig, spark=None) -> dict:
    """Run the stage; returns {"files": [...per-file counts...], "hlf": path, "llf": path,
    "scaling": path, "report": path, "splits": {...}}. See the module docstring."""
    from ..schemas import SCHEMA_DIR, load_schema

    t_start = time.time()
    schema_dir = Path(cfg.schema_dir) if cfg.schema_dir else SCHEMA_DIR
    for name in ("hlf", "llf"):       # a missing or broken schema fails before any work
        load_schema(name, SCHEMA_VERSIONS[name], schema_dir)
    versions: dict = {}
    files, units, labels, notes = plan_units(cfg, versions)
    for n in notes:
        log.info("%s", n)
    if not [f for f in files if not f.error]:
        first = files[0] if files else None
        raise BadInputError(f"no input file could be used; {first.path}: {first.error}" if first
                            else "no input files")
    out = location(cfg.output, output=True)  # a local path, a shared mount or s3://: the tasks write there
    check_writable(out)
    spark = spark or get_spark(cfg.spark)
    if not out.is_local or any(u.path.startswith("s3://") for u in units):
        forward_s3_settings(spark)
    log.info("features: %d work unit(s) from %d file(s) -> Spark tasks", len(units), len(files))
    received: Counter = Counter()
    ctx = tables_job(out, ("hlf", "llf"), "features") if cfg.output_format == "delta" else output_job(out)
    with ctx as job:
        units, st = run_units(spark, files, units, job.target, cfg, t_start, received)
        if not [f for f in files if not f.error]:    # nothing to write: no output at all
            first = files[0]
            raise BadInputError(f"no input file could be used; {first.path}: {first.error}")
        t = tally(files, units, labels, st)
        rule, counts, received["split"] = choose_rule(spark, _ranges(units, st, t, labels), t.per_label, cfg.seed,
                                                      cfg.test_fraction, cfg.val_fraction, cfg.balance_classes)
        log.info("features: split%s decided (%.1f s)", " and balancing" if cfg.balance_classes else "",
                 time.time() - t_start)
        groups, sizes, done = _groups(units, st, t, labels, counts, cfg, default_parallelism(spark))
        if groups:
            w = write_datasets(spark, job.target, groups, sizes, rule, cfg)
            received["write"] += w.received
            _check_written(w, groups, st, done, counts, labels)
            job.add(w.results)
            model, written = model_of(w.hlf, w.llf), w.chunks
        else:
            write_empty(job)
            model, written = model_of(Moments.empty(N_HLF), Moments.empty(N_LLF_FEATURES)), {}
        _validate(job, schema_dir)
        job.write_json("scaling.json", model.to_file().model_dump())
        log.info("features: hlf/ and llf/ written (%d LLF file(s), %d train events in the scaling) (%.1f s)",
                 len(groups), model.hlf_count, time.time() - t_start)
        report = _report(cfg, files, labels, t, done, written, counts, notes, out)
        if versions:        # the Delta table versions the features were built from
            report["input_versions"] = versions
        report |= {"driver_received_bytes": dict(received), "seconds": round(time.time() - t_start, 3)}
        job.write_json("report.json", report)
    finish(report, out, len(files), sum(report["splits"].values()), report["splits"], cfg.allow_bad_files)
    return report
