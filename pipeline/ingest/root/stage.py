"""Any TTree or RNTuple -> Parquet on Spark (``jobs/ingest_root.py``): the driver's side.

1. **Plan.** :func:`~.files.resolve_files` expands the inputs. The driver opens the first good
   file's tree and resolves the branch selection there (uproot ``filter_name`` semantics); the
   Arrow schema comes from a REAL read of the first entry (:mod:`.schema`). When that file is one
   chunk, the driver reads it whole for the schema and writes its part itself, so that no task
   reads the file a second time; when it is several, its chunks go to the second pass directly.
2. **First pass, one Spark task per file, then a second pass, one task per chunk of the larger
   files** (:mod:`.twopass`, task bodies in :mod:`.tasks`): the tasks write their parts straight
   to the output's filesystem under the job's prefix (:mod:`pipeline.commit`); only a small status
   row per file or chunk comes back. Where a file of several chunks is planned (the driver, or
   its first-pass task), each chunk gets the basket map of its range (:func:`~.baskets.basket_maps`):
   its task reads the flat and plain jagged branches from it without opening the file's tree.
3. **Commit.** A file that cannot be opened, lacks the tree or a requested branch, or fails while
   being read (or takes longer than ``file_timeout_s``) is reported (file, reason) in
   ``_report.json`` and one log line; its parts are not committed. The good files' parts, the
   report and ``_schema.json`` are committed in one step (a rename locally, ``_COMPLETE`` on an
   object store). If any file failed the function raises :class:`BadInputError` after the commit,
   unless ``allow_bad_files`` is set; if no file can be read at all, nothing is written.
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Optional

from ...commit import OutputJob, output_job
from ...errors import BadInputError
from ...fs import location
from ...paths_overlap import check_apart
from ...spark import default_parallelism, forward_s3_settings, get_spark, spark_task, task_frame
from ...tables import quarantine
from ...tables.job import check_table_target, delta_job
from ...tables.types import delta_schema
from .config import PARQUET_WRITE_OPTIONS, IngestRootConfig, default_schema_name
from .files import resolve_files
from .planning import Chunk, Plan, chunks_dataframe, plan_chunks
from .schema import conform, schema_bytes
from .table import check_partitions, check_schema, nothing_new, prepare_commit, select_inputs, table_report
from .tasks import SCAN_FIELDS, STATUS_FIELDS, ingest_partition, part_name, result_ddl, scan_partition
from .trees import first_line
from .twopass import FilePlanning, second_pass_chunks

log = logging.getLogger(__name__)


def plan_ingest_root(cfg: IngestRootConfig) -> dict:
    """--dry-run: the resolved inputs and outputs (no file is opened, Spark is not started)."""
    files = resolve_files(cfg.input)
    out = location(cfg.output, output=True)
    check_apart(out, files, replaces=cfg.output_format == "parquet")
    if cfg.output_format == "delta":
        return {"inputs": files, "tree": cfg.tree, "filter_name": cfg.filter_name, "output": str(out),
                "output_format": "delta", "mode": cfg.mode, "on_changed": cfg.on_changed,
                "partition_by": cfg.partition_by, "file_timeout_s": cfg.file_timeout_s,
                "quarantine_after": cfg.quarantine_after, "quarantined": quarantine.listing(out)}
    return {"inputs": files, "tree": cfg.tree, "filter_name": cfg.filter_name, "step_size": cfg.step_size,
            "file_timeout_s": cfg.file_timeout_s, "output": str(out), "report": str(out.child("_report.json")),
            "schema": str(out.child("_schema.json")), "schema_name": cfg.schema_name or default_schema_name(cfg.tree)}


def ingest_root(cfg: IngestRootConfig, spark=None) -> dict:
    """Ingest the ROOT files of ``cfg`` into one Parquet directory, or into a Delta table
    (``output_format: delta``, :mod:`.table`); returns the run report.

    Raises BadInputError (after committing the good files) if a file failed and
    ``allow_bad_files`` is false, or if no file could be read at all.
    """
    t_start = time.time()
    files = resolve_files(cfg.input)
    out = location(cfg.output, output=True)
    delta = cfg.output_format == "delta"
    check_apart(out, files, replaces=not delta)   # before any work: no input inside the output
    run = None
    if delta:
        check_table_target(out)
        n_inputs = len(files)
        run = select_inputs(cfg, files, out)
        if cfg.mode == "new_files":          # quarantined inputs skipped, one line each (pipeline.tables.quarantine)
            run.state = quarantine.read_state(out)
            run.files, run.quarantined = quarantine.split(run.files, run.stats, run.state, cfg.retry_quarantined)
        if not run.files:
            return nothing_new(cfg, run, out, n_inputs)
        files = run.files
    log.info("ingest_root: %d file(s), tree %r, branches %s", len(files), cfg.tree, cfg.filter_name)
    spark = spark or get_spark(cfg.spark)
    spread = chunk_spread(default_parallelism(spark), len(files))
    ref = plan_chunks(files, cfg.tree, cfg.filter_name, cfg.step_size, cfg.entry_start, cfg.entry_stop,
                      stop_after_first_good=True, file_timeout_s=cfg.file_timeout_s, keep_first_chunk=True,
                      spread=spread, baskets=True)
    if ref.schema is None:
        if run is not None and run.state is not None and run.state.version is not None:
            return _failures_only(cfg, run, out, [{"file": f.path, "error": f.error} for f in ref.files], t_start)
        raise BadInputError(f"no input file could be read; {files[0]}: {ref.files[0].error}")
    if run is not None:
        check_partitions(cfg, files, ref.branches)
        ref.schema = delta_schema(ref.schema)           # the types a Delta table stores (no unsigned)
        check_schema(cfg, out, ref.schema, next(f.path for f in ref.files if not f.error))
    if not out.is_local or any(f.startswith("s3://") for f in files):   # the tasks reach the store themselves
        forward_s3_settings(spark)
    if run is not None:
        return _ingest_table(spark, cfg, files, ref, run, out, t_start, spread)
    with output_job(out) as job:
        per_file = _run(spark, cfg, files, ref, job, spread)
        n_rows = sum(f["rows"] for f in per_file if not f.get("error"))
        if not any(rel.endswith(".parquet") for rel in job.kept()):
            job.write_table("part-empty.parquet", ref.schema.empty_table())   # readers still see the columns
        report = _report(cfg, ref, per_file, n_rows, str(out), t_start, job)
    _print_files(per_file)
    log.info("ingest_root: %d rows from %d good file(s), %d bad -> %s", n_rows,
             len(per_file) - len(report["bad_files"]), len(report["bad_files"]), report["output"])
    _raise_bad(cfg, report, len(files), f"{report['output']}/_report.json")
    return report


def _ingest_table(spark, cfg: IngestRootConfig, files: list[str], ref: Plan, run, out, t_start: float,
                  spread: int) -> dict:
    """The two passes into a Delta table's job, committed as one log entry (:mod:`pipeline.tables.job`)."""
    first = next(f.path for f in ref.files if not f.error)
    try:
        with delta_job(out, partition_by=(cfg.partition_by,) if cfg.partition_by else (),
                       overwrite=cfg.mode == "overwrite", add_columns=cfg.schema_changes == "add_columns") as job:
            per_file = _run(spark, cfg, files, ref, job, spread)
            n_rows = sum(f["rows"] for f in per_file if not f.get("error"))
            bad = [f for f in per_file if f.get("error")]
            if len(bad) == len(per_file):              # no data to commit: the table's rows stay as they were
                if run.state is None or run.state.version is None:
                    raise BadInputError(f"no input file could be ingested; {bad[0]['file']}: {bad[0]['error']}")
                raise _NothingGood(bad)
            prepare_commit(job, cfg, run, ref.schema, first, per_file)
            if run.state is not None:                  # the failures counted, quarantined at quarantine_after
                quarantine.mark(job.record, run.stats, run.state, cfg.quarantine_after)
    except _NothingGood as e:                          # the job aborted: only its failures are committed
        return _failures_only(cfg, run, out, e.bad, t_start)
    report = table_report(job, cfg, run, per_file, n_rows, ref.branches, time.time() - t_start)
    report["quarantined"] = job.record.get("quarantined") or []
    _print_files(per_file)
    print(f"{out}: version {job.version}: {n_rows} rows from {len(per_file) - len(report['bad_files'])} new "
          f"file(s) added ({run.held} input file(s) already in the table)")
    _raise_bad(cfg, report, len(files), f"the commit record of version {job.version}")
    return report


class _NothingGood(Exception):
    def __init__(self, bad: list[dict]) -> None:
        super().__init__("no input file could be ingested")
        self.bad = bad


def _failures_only(cfg: IngestRootConfig, run, out, bad: list[dict], t_start: float) -> dict:
    """An only-new run on a table whose every new input failed: a version that changes no data
    records the failures (each failed run counts toward ``quarantine_after``); the run fails like
    any run with a bad file, unless every bad file is quarantined now."""
    record = {"stage": "ingest_root", "tree": cfg.tree, "mode": cfg.mode, "sources": [], "replaced": [],
              "job": quarantine.job_id(), "bad_files": [{"file": f["file"], "reason": f["error"]} for f in bad]}
    quarantined = quarantine.mark(record, run.stats, run.state, cfg.quarantine_after)
    version = quarantine.record_failures(out, record)
    print(f"{out}: version {version}: no rows added; {len(bad)} new input file(s) failed (recorded, "
          f"{len(quarantined)} quarantined)")
    report = {"job": "ingest_root", "output_format": "delta", "tree": cfg.tree, "filter_name": cfg.filter_name,
              "branches": [], "output": str(out), "version": version, "mode": cfg.mode, "rows": 0, "files": bad,
              "new_files": len(bad), "held_files": run.held, "bad_files": record["bad_files"],
              "quarantined": quarantined, "seconds": round(time.time() - t_start, 3)}
    _raise_bad(cfg, report, len(bad), f"the commit record of version {version}")
    return report


def _print_files(per_file: list[dict]) -> None:
    for f in per_file:
        if not f.get("error"):
            print(f"{f['file']}: {f['entries']} entries read, {f['rows']} rows written in {len(f['parts'])} part(s)")


def _raise_bad(cfg: IngestRootConfig, report: dict, n_files: int, where: str) -> None:
    """The run fails for its bad files, except the ones it quarantined (they are skipped from now on)."""
    held_back = {q["file"] for q in report.get("quarantined") or []}
    bad = [b for b in report["bad_files"] if b["file"] not in held_back]
    if bad and not cfg.allow_bad_files:
        b = bad[0]
        raise BadInputError(f"{len(bad)} of {n_files} input file(s) failed (see {where}); "
                            f"{b['file']}: {b['reason']}")


def chunk_spread(slots: int, n_files: int) -> int:
    """With fewer input files than task slots, each file of several chunks is cut into a multiple
    of ceil(slots / files) chunks, so that one large file keeps every slot busy; otherwise the
    files themselves spread over the slots (1)."""
    return -(-slots // n_files) if 0 < n_files < slots else 1


def _run(spark, cfg: IngestRootConfig, files: list[str], ref: Plan, job: OutputJob, spread: int = 1) -> list[dict]:
    """Both passes; the per-file report. The parts of the good files are kept in ``job``. The
    first good file was planned on the driver (for the schema): written there when it is one
    chunk, else its chunks go to the second pass directly, without a first-pass task."""
    errors = {f.file_index: f.error for f in ref.files if f.error}
    first_good = len(ref.files) - 1
    branches, schema = ref.branches, ref.schema
    first = _write_first(ref, first_good, job, cfg.row_group_rows) or _planned_first(ref, first_good)
    todo = [(i, p) for i, p in enumerate(files) if i >= first_good and not (first and i == first_good)]
    planning = FilePlanning(cfg.tree, branches, cfg.step_size, cfg.filter_name, cfg.entry_start, cfg.entry_stop,
                            cfg.file_timeout_s, spread)
    scanned = dict(first)
    if todo:
        scan = functools.partial(scan_partition, planning=planning, schema=schema_bytes(schema), target=job.target,
                                 row_group_rows=cfg.row_group_rows)
        fdf = task_frame(spark, todo, "file_index int, path string")
        scanned.update((r["file_index"], r.asDict()) for r in
                       fdf.mapInArrow(spark_task(scan), result_ddl(SCAN_FIELDS)).collect())
    large = {fi: r for fi, r in scanned.items() if not r["error"] and not r["done"]}
    chunks = second_pass_chunks(files, cfg.tree, {fi: (r["starts"], r["stops"]) for fi, r in large.items()},
                                {fi: r["baskets"] for fi, r in large.items()})
    statuses = []
    if chunks:
        log.info("ingest_root: %d chunk(s) of %d large file(s) -> Spark tasks", len(chunks),
                 len({c.file_index for c in chunks}))
        fn = functools.partial(ingest_partition, branches=branches, schema=schema_bytes(schema), target=job.target,
                               row_group_rows=cfg.row_group_rows, timeout_s=cfg.file_timeout_s)
        statuses = [r.asDict() for r in chunks_dataframe(spark, chunks).mapInArrow(
            spark_task(fn), result_ddl(STATUS_FIELDS)).collect()]
    per_file = _summarise(files, errors, scanned, chunks, statuses)
    good = {f["file_index"] for f in per_file if not f.get("error")}
    job.add({"attempt_dir": r["attempt_dir"], "files": r["files"] if r["file_index"] in good else []}
            for r in [*scanned.values(), *statuses] if r.get("attempt_dir"))
    return per_file


def _write_first(ref: Plan, fi: int, job: OutputJob, row_group_rows: Optional[int]) -> dict:
    """The first good file, when the driver read it whole for the schema (one chunk): written here
    rather than read again by a task; its scan row ({} when a task must convert it)."""
    table, ref.first_table = ref.first_table, None
    if table is None:
        return {}
    part = part_name(fi, 0)
    try:
        n = table.num_rows
        job.write_table(part, conform(table, ref.schema), row_group_size=row_group_rows, **PARQUET_WRITE_OPTIONS)
    except Exception as e:  # noqa: BLE001 - a task converts it and reports it
        log.info("first file written by a task (%s)", first_line(e))
        return {}
    return _scan_row(ref, fi, [(0, table.num_rows)], done=True, rows=[n], parts=[part if n else None])


def _planned_first(ref: Plan, fi: int) -> dict:
    """The scan row of the first good file from the driver's plan, when it is several chunks ({}
    otherwise: a task converts it)."""
    mine = [c for c in ref.chunks if c.file_index == fi]
    if len(mine) <= 1:
        return {}
    return _scan_row(ref, fi, [(c.entry_start, c.entry_stop) for c in mine], done=False, rows=[], parts=[],
                     baskets=[c.baskets for c in mine])


def _scan_row(ref: Plan, fi: int, ranges: list, *, done: bool, rows: list, parts: list,
              baskets: Optional[list] = None) -> dict:
    """The first pass's row (:data:`~.tasks.SCAN_FIELDS`) of a file the driver planned."""
    return {fi: {"file_index": fi, "entries": ref.files[fi].entries, "starts": [a for a, _ in ranges],
                 "stops": [b for _, b in ranges], "rows": rows, "parts": parts, "done": done, "error": None,
                 "baskets": baskets or []}}


def _summarise(files: list[str], errors: dict, scanned: dict, chunks: list[Chunk], statuses: list[dict]) -> list[dict]:
    """Per-file report (one log line per bad file); a file with a failed chunk keeps no part."""
    by_file: dict[int, list[dict]] = {}
    chunk_of = {c.chunk_id: c for c in chunks}
    for s in statuses:
        by_file.setdefault(s["file_index"], []).append(s)
    out = []
    for fi, path in enumerate(files):
        r = scanned.get(fi)
        parts: list[dict] = []
        err = errors.get(fi) or (r["error"] if r else None)
        if r and not err:
            if r["done"]:
                parts = [{"part": p, "rows": n, "entry_start": a, "entry_stop": b}
                         for p, n, a, b in zip(r["parts"], r["rows"], r["starts"], r["stops"]) if p]
            else:
                sts = sorted(by_file.get(fi, []), key=lambda s: s["chunk_id"])
                err = next((s["error"] for s in sts if s["error"]), None)
                parts = [{"part": s["part"], "rows": s["rows"], "entry_start": chunk_of[s["chunk_id"]].entry_start,
                          "entry_stop": chunk_of[s["chunk_id"]].entry_stop} for s in sts if s["part"]]
        if err:
            if fi not in errors:
                log.warning("bad input file %s: %s", path, err)
            parts = []
        out.append({"file": path, "file_index": fi, "entries": r["entries"] if r else 0,
                    "rows": sum(p["rows"] for p in parts), "parts": parts, "error": err})
    return out


def _report(cfg: IngestRootConfig, ref: Plan, per_file: list[dict], n_rows: int, output: str, t_start: float,
            job: OutputJob) -> dict:
    """``_report.json`` and ``_schema.json`` (the derived schema, registered), written into the job."""
    from ...schemas import register_schema

    name = cfg.schema_name or default_schema_name(cfg.tree)
    ds = register_schema(name, ref.schema, description=f"ROOT tree {cfg.tree!r} ingested by jobs/ingest_root.py",
                         metadata={"tree": cfg.tree, "filter_name": cfg.filter_name},
                         registry_dir=Path(cfg.schema_dir) if cfg.schema_dir else None)
    report = {"job": "ingest_root", "tree": cfg.tree, "filter_name": cfg.filter_name,
              "branches": ref.branches, "schema": {"name": ds.name, "version": ds.version},
              "output": output, "rows": n_rows, "files": per_file,
              "bad_files": [{"file": f["file"], "reason": f["error"]} for f in per_file if f.get("error")],
              "seconds": round(time.time() - t_start, 3)}
    job.write_json("_report.json", report)
    job.write_json("_schema.json", ds.to_json())
    return report
