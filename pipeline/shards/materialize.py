"""Materialise a data-assignment layout: every worker's Parquet directory, the evaluation splits
and ``manifest.json`` (docs/shards.md).

Input: a Parquet dataset with at least ``sample_id`` (integer, unique) and ``split`` (string)
columns, e.g. the images dataset or the HEP ``hlf/`` / ``llf/`` datasets, on a local path, a
shared mount or ``s3://`` (read in the tasks through ``pyarrow.fs``). The ``train`` split is
assigned to workers by :mod:`pipeline.shards.schemes`; every other split is copied unchanged to
``eval/<split>/`` (``eval/test`` and ``eval/val`` always exist, empty if the input has no such
rows).

The driver never reads the rows' keys; it handles per-file and per-row-group counts:

1. :mod:`~pipeline.shards.scan`: one Spark pass counts the rows of each split per row group and
   checks the keys (no nulls, unique ids, usable split names);
2. :mod:`~pipeline.shards.route`: the tasks read their row groups, give each training row its
   position (row group offset + index) and its workers (:class:`~pipeline.shards.schemes.Router`:
   a keyed bijection per row, no table of the samples), each evaluation row its split's directory,
   and a partition key; Spark repartitions by that key so that every destination lands in exactly
   one writer task (destinations packed onto ``write_tasks`` partitions by their row counts, which
   the driver knows from the layout: :func:`partition_keys` asks Spark which ``pmod(hash(k), n)``
   each small integer k gets) and sorts each partition by (destination, order);
3. :mod:`~pipeline.shards.write`: one Parquet file per destination, written by the task's attempt
   of the commit protocol (:mod:`pipeline.commit`) under the job's prefix on the output's
   filesystem; the driver checks every destination received exactly its rows, writes
   ``manifest.json`` (:class:`pipeline.shards.manifest.ShardManifest`) and commits (a rename on a
   local path; ``_COMPLETE`` on an object store, which readers check).
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Literal, Optional

import numpy as np
from pydantic import Field

from ..commit import output_job
from ..config import StageConfig
from ..errors import BadInputError, PipelineError
from ..fs import Location, check_writable, location
from ..paths_overlap import check_apart
from ..schemas import pad_length
from ..spark import default_parallelism, forward_s3_settings, get_spark, spark_task
from .manifest import MANIFEST_NAME, LayoutSpec, ShardManifest, TensorSpec, WorkerShard
from .route import DEST, ORDER, PKEY, TRAIN_SPLIT, routed_frame
from .scan import Scan, scan
from .schemes import SCHEMES, Layout, Router, check_sample_count, resolve_layout, worker_groups
from .tensors import TENSOR_COLUMNS, is_numeric_list
from .write import WRITE_DDL, output_schema, write_partition, writer_options

log = logging.getLogger(__name__)

EVAL_SPLITS = ("test", "val")          # always written (empty when the input has none)


class ShardConfig(StageConfig):
    """Config of the shard stage (``jobs/shard.py``, defaults in ``configs/shard.yaml``)."""

    input: str = Field("runs/hep/features/hlf", description="input Parquet dataset (needs sample_id and split): a "
                                                          "local path or s3://bucket/prefix, or a Delta table "
                                                          "(its snapshot's files)")
    input_version: Optional[int] = Field(None, ge=0, description="a Delta table input: the version to read (time "
                                         "travel; default: the newest)")
    output: str = Field("runs/hep/shards", description="output directory or s3://bucket/prefix (replaced atomically; "
                                                   "docs/storage.md)")
    scheme: Literal["disjoint", "full_overlap", "coarse", "medium_coarse", "fine_grained", "households",
                    "neighbourhoods"] = Field("disjoint", description="assignment scheme: " + ", ".join(SCHEMES))
    workers: int = Field(2, gt=0, description="number of workers M")
    copies: Optional[int] = Field(None, ge=1, description="copies C of each sample (medium_coarse, fine_grained; "
                                                          "other schemes derive it, a given value must match)")
    shards: Optional[int] = Field(None, ge=1, description="coarse: number of shards S (divides workers)")
    households: Optional[int] = Field(None, ge=1, description="households/neighbourhoods: households H (divides workers)")
    household_shards: Optional[int] = Field(None, ge=1, description="household shards S_H (divides H; default H, "
                                                                    "neighbourhoods: H/NB)")
    neighbourhoods: Optional[int] = Field(None, ge=1, description="neighbourhoods: NB (divides households)")
    seed: int = Field(0, ge=0, description="seed of the assignment and of the per-worker shuffle seeds")
    shuffle: bool = Field(True, description="randomise which samples go to which shard (false: contiguous "
                                            "ranges of the input's training rows)")
    row_group_rows: int = Field(1024, gt=0, description="rows per Parquet row group in the shards")
    tensor_columns: list[str] = Field(list(TENSOR_COLUMNS), description="list columns written as one fixed-size "
                                      "binary tensor per row when present (docs/loader.md); [] keeps lists")
    write_tasks: Optional[int] = Field(None, gt=0, description="Spark tasks writing the directories (each "
                                       "directory is written by one task); default: Spark's default parallelism")

    def layout(self) -> Layout:
        return resolve_layout(self.scheme, self.workers, self.copies, shards=self.shards,
                              households=self.households, household_shards=self.household_shards,
                              neighbourhoods=self.neighbourhoods, seed=self.seed, shuffle=self.shuffle)


def worker_dir_name(i: int, workers: int) -> str:
    return f"worker_{i:0{max(3, len(str(workers - 1)))}d}"


def plan_shard(cfg: ShardConfig) -> dict:
    """Inputs/outputs of a run, for ``--dry-run`` (checks the layout; no Spark, no data read)."""
    layout = cfg.layout()
    out = location(cfg.output, output=True)
    return {"input": str(location(cfg.input)), "output": str(out), "layout": layout.to_manifest(),
            "workers": [str(out.child(worker_dir_name(i, layout.workers))) for i in range(layout.workers)],
            "eval": {s: str(out.child("eval", s)) for s in EVAL_SPLITS},
            "manifest": str(out.child(MANIFEST_NAME))}


def _tensor_columns(sc: Scan, names: list[str]) -> dict[str, tuple[str, int]]:
    """{column: (dtype, length)} of the requested tensor columns present in the input; the
    length is the column's ``pad_to`` (:func:`pipeline.schemas.pad_length`: its rows are padded
    to it), else that of the first row (the writer checks every other row against it)."""
    import pyarrow.compute as pc

    out = {}
    for name in names:
        idx = sc.schema.get_field_index(name)
        if idx < 0:
            continue
        t = sc.schema.field(idx).type
        if not is_numeric_list(t):
            raise BadInputError(f"{sc.files[0]}: column {name!r} has type {t}; a tensor column needs a list of numbers")
        pad = pad_length(sc.schema.field(idx))
        if pad is not None:
            out[name] = (t.value_type.to_pandas_dtype().__name__, pad)
            continue
        first = _first_value(sc, name)
        if first is not None:
            out[name] = (t.value_type.to_pandas_dtype().__name__, int(pc.list_value_length(first)[0].as_py() or 0))
    return out


def _first_value(sc: Scan, name: str):
    """The first row of one column (one row read from the first non-empty file). The file is read
    as a stream (``buffer_size``): the driver decodes the column's first page, not the whole column
    chunk of a row group (which grows with the rows per row group)."""
    import pyarrow.parquet as pq

    for fi in sorted({g[0] for g in sc.groups if g[2]}):
        loc = location(sc.files[fi])
        with loc.filesystem().open_input_file(loc.path) as f:
            for batch in pq.ParquetFile(f, buffer_size=1 << 16, pre_buffer=False).iter_batches(columns=[name],
                                                                                                batch_size=1):
                if batch.num_rows:
                    return batch.column(0)
    return None


def partition_keys(spark, n: int) -> list[int]:
    """For each p in 0..n-1 a long k with ``pmod(hash(k), n) == p`` as Spark computes it, so that
    rows with key k land in partition p of ``repartition(n, key)``. One small Spark job over
    candidate keys 0..8n-1 (extended until every partition has a key)."""
    from pyspark.sql import functions as F

    keys: dict[int, int] = {}
    start, span = 0, 8 * n
    while len(keys) < n:
        rows = (spark.range(start, start + span, 1, 1)
                .select(F.col("id"), F.pmod(F.hash(F.col("id")), F.lit(n)).alias("p"))
                .groupBy("p").agg(F.min("id").alias("k")).collect())
        for r in rows:
            keys.setdefault(int(r.p), int(r.k))
        start += span
    return [keys[d] for d in range(n)]


def pack_destinations(rows: np.ndarray, tasks: int) -> np.ndarray:
    """Partition of each destination: largest first onto the least-loaded of ``tasks``
    partitions, so every destination is written by exactly one task and the tasks get
    about equal numbers of rows."""
    tasks = max(1, min(int(tasks), len(rows)))
    load = np.zeros(tasks, np.int64)
    part = np.zeros(len(rows), np.int64)
    for d in np.argsort(-rows, kind="stable"):
        p = int(np.argmin(load))
        part[d] = p
        load[p] += rows[d]
    return part


def _write(spark, job, sc: Scan, router: Router, eval_names: list[str], dirs: list[str], expected: np.ndarray,
           tensors: dict, cfg: ShardConfig) -> list:
    """The routing and writing pass: the writers' result rows."""
    from pyspark.sql import functions as F

    tasks = max(1, min(len(dirs), cfg.write_tasks or default_parallelism(spark)))
    keys = partition_keys(spark, tasks)
    pkeys = [keys[p] for p in pack_destinations(expected, tasks)]
    # Arrow batches bounded in bytes (LLF rows are ~60 kB each)
    per_batch = int(min(10_000, max(64, (64 << 20) // max(1.0, sc.bytes_per_row()))))
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    old = spark.conf.get(key, None)
    spark.conf.set(key, str(per_batch))
    try:
        routed = (routed_frame(spark, sc, router, eval_names, pkeys, per_batch).repartition(tasks, PKEY)
                  .sortWithinPartitions(DEST, ORDER).select(*[F.col(f"`{c}`") for c in sc.schema.names], F.col(DEST)))
        fn = functools.partial(write_partition, target=job.target, dirs=dirs, row_group_rows=cfg.row_group_rows,
                               schema_bytes=sc.schema.serialize().to_pybytes(), tensors=tensors)
        return routed.mapInArrow(spark_task(fn), WRITE_DDL).collect()
    finally:
        if old is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, old)


def _check_paths(cfg: ShardConfig) -> tuple[Location, Location]:
    """The input and the output location, checked before any work: neither inside the other
    (:func:`pipeline.paths_overlap.check_apart`), and on an object store the bucket, the
    credentials and the write permission (one line naming the URI)."""
    src = location(cfg.input)
    out = location(cfg.output, output=True)
    check_apart(out, [src])
    check_writable(out)
    return src, out


def shard(cfg: ShardConfig, spark=None) -> dict:
    """Write the layout's worker directories, eval splits and ``manifest.json``; return the manifest
    (its JSON form)."""
    t0 = time.time()
    layout = cfg.layout()
    src, out = _check_paths(cfg)
    spark = spark or get_spark(cfg.spark)
    sc, received = scan(spark, src, cfg.input_version)
    totals = sc.totals()
    N = totals.get(TRAIN_SPLIT, 0)
    if N == 0:
        raise BadInputError(f"{src}: no rows with split='train' to assign")
    check_sample_count(layout, N)
    tensors = _tensor_columns(sc, cfg.tensor_columns)
    eval_names = sorted(set(EVAL_SPLITS) | (set(totals) - {TRAIN_SPLIT}))
    router = Router.of(layout, N)
    M = layout.workers
    dirs = [worker_dir_name(i, M) for i in range(M)] + [f"eval/{s}" for s in eval_names]
    expected = np.concatenate([router.sizes(), [totals.get(s, 0) for s in eval_names]]).astype(np.int64)
    log.info("shard: %s layout, M=%d, C=%d, N=%d train samples (+ %s); one Spark pass writing %d rows into %d "
             "directories", layout.scheme, M, layout.copies, N, ", ".join(f"{s} {totals.get(s, 0)}" for s in eval_names),
             int(expected.sum()), len(dirs))
    if not out.is_local:
        forward_s3_settings(spark)
    with output_job(out) as job:
        summary = _write(spark, job, sc, router, eval_names, dirs, expected, tensors, cfg)
        errors = [r.error for r in summary if r.error]
        if errors:
            raise BadInputError(f"{src}: {errors[0]}")
        job.add(summary)
        files: dict[int, list[str]] = {d: [] for d in range(len(dirs))}
        rows = np.zeros(len(dirs), np.int64)
        for r in summary:
            if r.dest >= 0:
                files[r.dest].append(r.file)
                rows[r.dest] += r.rows
        bad = np.flatnonzero(rows != expected)
        if bad.size:
            d = int(bad[0])
            raise PipelineError(f"shard: {dirs[d]} received {rows[d]} rows, expected {expected[d]} "
                                f"(input changed during the run?)")
        schema = output_schema(sc.schema, tensors)
        for d, name in enumerate(dirs):
            if not files[d]:
                job.write_table(f"{name}/part-empty.parquet", schema.empty_table(), **writer_options(schema, tensors))
                files[d].append("part-empty.parquet")
        manifest = ShardManifest(
            source=str(src), layout=LayoutSpec(**layout.to_manifest()), n_train_samples=N,
            row_group_rows=cfg.row_group_rows, eval={s: str(out.child("eval", s)) for s in eval_names},
            tensors={c: TensorSpec(dtype=d, length=k) for c, (d, k) in tensors.items()},
            workers=[WorkerShard(worker=i, path=str(out.child(dirs[i])), files=sorted(files[i]), rows=int(rows[i]),
                                 seed=router.seeds[i], group=g) for i, g in enumerate(worker_groups(layout))])
        job.write_json(MANIFEST_NAME, manifest.model_dump(mode="json"))
    log.info("shard: wrote %d worker directories + eval (%s) to %s in %.1f s (the driver received %d bytes from "
             "the scan)", M, ", ".join(eval_names), out, time.time() - t0, received)
    return manifest.model_dump(mode="json")
