"""Materialise a data-assignment layout: ONE Spark pass writes every worker's Parquet directory.

Input: a Parquet dataset with at least ``sample_id`` (integer, unique) and ``split`` (string)
columns, e.g. the images dataset or the HEP ``hlf/`` / ``llf/`` datasets. The ``train`` split is
assigned to workers by :mod:`pipeline.shards.schemes`; every other split is copied unchanged
to ``eval/<split>/`` (``eval/test`` and ``eval/val`` always exist, empty if the input has no such
rows).

How the single pass works:

1. The driver reads only the two key columns (``sample_id``, ``split``) with pyarrow, checks
   them, and runs the pure assignment function.
2. It builds a small *routing table* ``(sample_id, split) -> (dest, order)``: one row per
   (sample, worker) pair (N*C rows) plus one row per eval sample, with ``dest`` = worker index,
   or M + j for eval split j, and ``order`` = the row's position in its destination.
3. Spark scans the input once, broadcast-joins it with the routing table (this is where a
   sample held by C workers becomes C rows), repartitions into ``write_tasks`` partitions (default:
   Spark's default parallelism) so that every destination lies in exactly one partition (the
   destinations are packed onto the partitions by row count, and the routing table carries a
   partition key that Spark itself maps to the chosen partition: :func:`partition_keys` asks
   Spark which ``pmod(hash(k), n)`` each small integer k gets), sorts each partition by
   (dest, order) and hands it to a ``mapInArrow`` writer. Few, large writer tasks matter: each
   Python task costs a fixed overhead, so one task per worker directory would dominate small runs.
4. The writer casts each Arrow batch back to the input's Arrow schema (Spark would turn e.g.
   uint8 into int16; the shards keep the input's exact columns and types), encodes the feature
   columns of ``tensor_columns`` as one fixed-size binary tensor per row
   (:mod:`pipeline.shards.tensors`) and writes one ``<dest>/part-<partition>.parquet`` per
   destination with pyarrow in row groups of exactly ``row_group_rows`` rows (the last one
   smaller). It returns one summary row per file written (or the error of a bad row).
5. The driver checks that every destination received exactly the rows it was routed, removes
   files of failed task attempts, and writes ``manifest.json``
   (:class:`pipeline.shards.manifest.ShardManifest`): layout (scheme, workers, copies, the
   scheme's parameters, seed), N, row-group size, eval paths and, per worker, its directory,
   files, row count, sample ids as sorted inclusive ranges, shuffle seed and household /
   neighbourhood group.

Everything is written through :func:`pipeline.outputs.atomic_output_dir`, so ``output`` is replaced
only when complete:

* a local path (or ``file://``): the tasks write into a temporary sibling directory, renamed into
  place at the end;
* an ``s3://bucket/prefix``: the target is checked before any work (bucket, credentials, write
  permission: one line, exit code 2, nothing written); the tasks write into a local staging
  directory, which is uploaded under a temporary prefix, moved into place and committed with the
  ``_COMPLETE`` marker that readers check (:func:`pipeline.shards.manifest.load_manifest`). The
  manifest then lists the worker and eval directories as ``s3://`` URIs, which training reads in
  place (:mod:`pipeline.data.parquet`).

The writer tasks write with plain file I/O into the driver's staging directory, so they must share
the driver's disk: true for a local master (``local[*]``, ``local-cluster[...]``), which is what
runs here. A multi-node cluster would need either the tasks writing their files directly under the
temporary prefix through :mod:`pyarrow.fs` (the commit then moves them and writes the marker) or a
staging directory on a filesystem every node mounts; until one of these exists an ``s3://`` output
with a non-local master is refused before any work (:func:`pipeline.outputs.check_staging`).
"""
from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from pydantic import Field

from ..config import StageConfig
from ..errors import BadInputError, ConfigError, PipelineError
from ..fs import Location, check_writable, location
from ..outputs import atomic_output_dir, check_staging, local_path, require_exists, uri
from ..schemas import pad_length, parquet_schema
from ..spark import spark_task
from .manifest import MANIFEST_NAME, LayoutSpec, ShardManifest, TensorSpec, WorkerShard
from .schemes import SCHEMES, Assignment, Layout, assign, check_sample_count, id_ranges, resolve_layout
from .tensors import TENSOR_COLUMNS, encode, is_numeric_list, tensor_field

log = logging.getLogger(__name__)

EVAL_SPLITS = ("test", "val")          # always written (empty when the input has none)
TRAIN_SPLIT = "train"
_DEST, _PKEY, _ORDER = "__shard_dest", "__shard_pkey", "__shard_order"
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")


class ShardConfig(StageConfig):
    """Config of the shard stage (``jobs/shard.py``, defaults in ``configs/shard.yaml``)."""

    input: str = Field("runs/images/dataset", description="input Parquet dataset (needs sample_id and split)")
    output: str = Field("runs/shards", description="output directory or s3://bucket/prefix (replaced atomically; "
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
                                            "sample_id ranges)")
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
    return {"input": str(local_path(cfg.input)), "output": str(out), "layout": layout.to_manifest(),
            "workers": [str(out.child(worker_dir_name(i, layout.workers))) for i in range(layout.workers)],
            "eval": {s: str(out.child("eval", s)) for s in EVAL_SPLITS},
            "manifest": str(out.child(MANIFEST_NAME))}


# ----------------------------------------------------------------------------- input checks
def _check_input(path: Path):
    """The input's Arrow schema, after checking the key columns; BadInputError otherwise."""
    import pyarrow as pa

    schema = parquet_schema(path)
    for col, ok, want in (("sample_id", pa.types.is_integer, "an integer type"),
                          ("split", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "string")):
        idx = schema.get_field_index(col)
        if idx < 0:
            raise BadInputError(f"{path}: missing column {col!r} (the shard stage needs sample_id and split)")
        t = schema.field(idx).type
        if not ok(t):
            raise BadInputError(f"{path}: column {col!r} has type {t}, expected {want}")
    for reserved in (_DEST, _PKEY, _ORDER):
        if reserved in schema.names:
            raise BadInputError(f"{path}: column {reserved!r} is reserved by the shard stage")
    return schema


def _tensor_columns(path: Path, schema, names: list[str]) -> dict[str, tuple[str, int]]:
    """{column: (dtype, length)} of the requested tensor columns present in the input; the
    length is the column's ``pad_to`` (:func:`pipeline.schemas.pad_length`: its rows are padded
    to it), else that of the first row (the writer checks every other row against it)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    out = {}
    for name in names:
        idx = schema.get_field_index(name)
        if idx < 0:
            continue
        t = schema.field(idx).type
        if not is_numeric_list(t):
            raise BadInputError(f"{path}: column {name!r} has type {t}; a tensor column needs a list of numbers")
        pad = pad_length(schema.field(idx))
        if pad is not None:
            out[name] = (t.value_type.to_pandas_dtype().__name__, pad)
            continue
        first = None
        for batch in ds.dataset(str(path), format="parquet", ignore_prefixes=[".", "_"]).to_batches(
                columns=[name], batch_size=1):
            if batch.num_rows:
                first = batch.column(0)
                break
        if first is None:
            continue
        out[name] = (t.value_type.to_pandas_dtype().__name__, int(pc.list_value_length(first)[0].as_py() or 0))
    return out


def _read_keys(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(sample_id int64, split str) of every row, checked: no nulls, unique ids, sane split names."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    try:
        t = ds.dataset(str(path), format="parquet", ignore_prefixes=[".", "_"]).to_table(
            columns=["sample_id", "split"])
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise BadInputError(f"cannot read Parquet at {path}: {str(e).splitlines()[0]}") from None
    for col in ("sample_id", "split"):
        nulls = t.column(col).null_count
        if nulls:
            raise BadInputError(f"{path}: column {col!r} has {nulls} null value(s)")
    ids = t.column("sample_id").to_numpy().astype(np.int64, copy=False)
    splits = np.asarray(pc.cast(t.column("split"), "string").to_numpy(zero_copy_only=False), dtype=object)
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        raise BadInputError(f"{path}: column 'sample_id' has duplicate value {int(uniq[counts > 1][0])}")
    for s in set(splits.tolist()):
        if not _SPLIT_NAME.match(s):
            raise BadInputError(f"{path}: column 'split' has value {s!r}, not usable as a directory name")
    return ids, splits


# ----------------------------------------------------------------------------- the Spark pass
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


def _routing_table(assignment: Assignment, train_ids: np.ndarray, eval_ids: dict[str, np.ndarray],
                   pkeys: list[int]):
    """pandas frame (sample_id, split, dest, pkey, order): one row per (sample, destination);
    ``pkeys[d]`` is the partition key of destination d."""
    import pandas as pd

    M = assignment.layout.workers
    parts = []
    for w, m in enumerate(assignment.members):
        parts.append((train_ids[m], TRAIN_SPLIT, w))
    for j, (name, ids) in enumerate(eval_ids.items()):
        parts.append((np.sort(ids), name, M + j))
    frames = [pd.DataFrame({"sample_id": ids.astype(np.int64), "split": split,
                            _DEST: np.full(len(ids), dest, np.int32),
                            _PKEY: np.full(len(ids), pkeys[dest], np.int64),
                            _ORDER: np.arange(len(ids), dtype=np.int64)})
              for ids, split, dest in parts if len(ids)]
    return pd.concat(frames, ignore_index=True)


def output_schema(schema, tensors: dict[str, tuple[str, int]]):
    """The shards' Arrow schema: the input's, with each tensor column as fixed-size binary."""
    import pyarrow as pa

    return pa.schema([tensor_field(f.name, *tensors[f.name]) if f.name in tensors else f for f in schema],
                     metadata=schema.metadata)


def writer_options(out_schema, tensors) -> dict:
    """ParquetWriter options: snappy; no dictionary or statistics for the tensor columns (every
    value is distinct, and min/max of a tensor's bytes are meaningless)."""
    plain = [f.name for f in out_schema if f.name not in tensors]
    return {"compression": "snappy", "use_dictionary": plain, "write_statistics": plain}


def _as_tensors(table, tensors: dict[str, tuple[str, int]], out_schema, padded: frozenset = frozenset()):
    """Encode the tensor columns of ``table`` (those in ``padded`` padded with zeros); ValueError
    naming the column on a bad row."""
    import pyarrow as pa

    cols = [encode(table.column(f.name), f.name, *tensors[f.name], pad=f.name in padded) if f.name in tensors
            else table.column(f.name) for f in out_schema]
    return pa.Table.from_arrays(cols, schema=out_schema)


def _make_writer(root: str, dirs: list[str], schema, row_group_rows: int, tensors: dict[str, tuple[str, int]]):
    """The ``mapInArrow`` function: Arrow batches (input columns + dest, sorted by dest) ->
    one Parquet file per destination in this partition, in row groups of ``row_group_rows``,
    tensor columns encoded (:mod:`pipeline.shards.tensors`). A row that breaks a tensor column
    stops the task and is reported in the summary's ``error``."""
    columns = list(schema.names)
    out_schema = output_schema(schema, tensors)
    padded = frozenset(f.name for f in schema if f.name in tensors and pad_length(f) is not None)

    def write(batches):
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        tc = TaskContext.get()
        tag = f"{tc.partitionId():05d}-a{tc.attemptNumber()}"
        done = {"dest": [], "file": [], "rows": [], "row_groups": [], "error": []}
        cur: dict = {}
        n_files: dict[int, int] = {}

        def put(table, final: bool) -> None:
            """Buffer rows; write every complete row group (and the rest when final)."""
            if table is not None and table.num_rows:
                cur["pending"].append(table)
                cur["n"] += table.num_rows
            n = cur["n"]
            if n == 0 or (n < row_group_rows and not final):
                return
            t = pa.concat_tables(cur["pending"])
            full = n if final else (n // row_group_rows) * row_group_rows
            cur["writer"].write_table(t.slice(0, full), row_group_size=row_group_rows)
            cur["groups"] += -(-full // row_group_rows)
            cur["rows"] += full
            rest = t.slice(full)
            cur["pending"], cur["n"] = ([rest] if rest.num_rows else []), rest.num_rows

        def close() -> None:
            if not cur:
                return
            put(None, final=True)
            cur["writer"].close()
            os.replace(cur["tmp"], cur["final"])
            for k in ("dest", "file", "rows", "row_groups"):
                done[k].append(cur[{"file": "name", "row_groups": "groups"}.get(k, k)])
            done["error"].append(None)
            cur.clear()

        def open_(dest: int) -> None:
            k = n_files.get(dest, 0)          # >0 only if a destination's rows were not contiguous
            n_files[dest] = k + 1
            name = f"part-{tag}.parquet" if k == 0 else f"part-{tag}-{k}.parquet"
            d = os.path.join(root, dirs[dest])
            tmp = os.path.join(d, f".{name}.inprogress")
            cur.update(dest=dest, name=name, tmp=tmp, final=os.path.join(d, name), rows=0, groups=0,
                       pending=[], n=0, writer=pq.ParquetWriter(tmp, out_schema, **writer_options(out_schema, tensors)))

        for b in batches:
            if b.num_rows == 0:
                continue
            dest = b.column(len(columns)).to_numpy()
            try:
                table = _as_tensors(pa.Table.from_batches([b]).select(columns).cast(schema), tensors, out_schema,
                                    padded)
            except ValueError as e:
                for k, v in (("dest", -1), ("file", ""), ("rows", 0), ("row_groups", 0), ("error", str(e))):
                    done[k].append(v)
                break
            cuts = np.flatnonzero(np.diff(dest)) + 1       # rows arrive sorted by dest
            for s, e in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(dest)]])):
                d = int(dest[s])
                if cur.get("dest") != d:
                    close()
                    open_(d)
                put(table.slice(s, e - s), final=False)
        close()
        yield pa.RecordBatch.from_arrays(
            [pa.array(done["dest"], pa.int32()), pa.array(done["file"], pa.string()),
             pa.array(done["rows"], pa.int64()), pa.array(done["row_groups"], pa.int32()),
             pa.array(done["error"], pa.string())],
            names=["dest", "file", "rows", "row_groups", "error"])

    return write


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


def _bytes_per_row(path: Path) -> float:
    """Uncompressed bytes per row of the input, from the Parquet footers (no data read)."""
    import pyarrow.dataset as ds

    rows = size = 0
    try:
        for frag in ds.dataset(str(path), format="parquet", ignore_prefixes=[".", "_"]).get_fragments():
            md = frag.metadata
            for i in range(md.num_row_groups):
                rows += md.row_group(i).num_rows
                size += md.row_group(i).total_byte_size
    except Exception:  # noqa: BLE001 - only a sizing hint
        return 1024.0
    return size / rows if rows else 1024.0


def _spark_pass(spark, in_path: Path, schema, routing, dirs: list[str], root: Path, row_group_rows: int,
                tasks: int, tensors: dict[str, tuple[str, int]]) -> list:
    """Scan once, route, write with ``tasks`` writer tasks; returns the writers' summary rows."""
    from pyspark.sql import functions as F

    # Arrow batch size handed to the writer: bounded in bytes (LLF rows are ~60 kB each)
    per_batch = int(min(10_000, max(64, (64 << 20) // max(1.0, _bytes_per_row(in_path)))))
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    old = spark.conf.get(key, None)
    spark.conf.set(key, str(per_batch))
    try:
        df = spark.read.parquet(uri(in_path))
        route = spark.createDataFrame(routing)
        cols = [F.col(f"`{c}`") for c in schema.names]
        routed = (df.join(F.broadcast(route), on=["sample_id", "split"], how="inner")
                  .repartition(tasks, _PKEY)
                  .sortWithinPartitions(_DEST, _ORDER)
                  .select(*cols, F.col(_DEST)))
        writer = _make_writer(str(root), dirs, schema, row_group_rows, tensors)
        return routed.mapInArrow(spark_task(writer),
                                 "dest int, file string, rows long, row_groups int, error string").collect()
    finally:
        if old is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, old)


def _write_empty(dir_: Path, schema) -> str:
    import pyarrow.parquet as pq

    name = "part-empty.parquet"
    pq.write_table(schema.empty_table(), dir_ / name, compression="snappy")
    return name


# ----------------------------------------------------------------------------- the stage
def _check_paths(cfg: ShardConfig) -> tuple[Path, Location]:
    """The input (a local dataset) and the output location, checked before any work: on an object
    store the bucket, the credentials and the write permission (one line naming the URI)."""
    in_path = require_exists(cfg.input)
    out = location(cfg.output, output=True)
    if out.is_local:
        o = Path(out.path)
        if o == in_path or in_path in o.parents or o in in_path.parents:
            raise ConfigError(f"output={out} overlaps input={in_path}")
    check_writable(out)
    return in_path, out


def shard(cfg: ShardConfig, spark=None) -> dict:
    """Write the layout's worker directories, eval splits and ``manifest.json``; return the manifest
    (its JSON form)."""
    from ..spark import get_spark

    t0 = time.time()
    layout = cfg.layout()
    in_path, out = _check_paths(cfg)
    schema = _check_input(in_path)
    tensors = _tensor_columns(in_path, schema, cfg.tensor_columns)
    ids, splits = _read_keys(in_path)
    is_train = splits == TRAIN_SPLIT
    train_ids = np.sort(ids[is_train])
    N = int(train_ids.size)
    if N == 0:
        raise BadInputError(f"{in_path}: no rows with split='train' to assign")
    check_sample_count(layout, N)
    eval_names = sorted(set(EVAL_SPLITS) | set(splits[~is_train].tolist()))
    eval_ids = {s: ids[splits == s] for s in eval_names}

    t1 = time.time()
    assignment = assign(layout, N)
    M = layout.workers
    log.info("shard: %s layout, M=%d, C=%d, N=%d train samples (+ %s) assigned in %.1f s", layout.scheme, M,
             layout.copies, N, ", ".join(f"{s} {len(v)}" for s, v in eval_ids.items()), time.time() - t1)

    spark = spark or get_spark(cfg.spark)
    check_staging(spark.sparkContext.master, out, "shard")
    dirs = [worker_dir_name(i, M) for i in range(M)] + [f"eval/{s}" for s in eval_names]
    expected = np.array([len(m) for m in assignment.members] + [len(v) for v in eval_ids.values()], np.int64)
    tasks = max(1, min(len(dirs), cfg.write_tasks or spark.sparkContext.defaultParallelism))
    part = pack_destinations(expected, tasks)
    keys = partition_keys(spark, tasks)
    routing = _routing_table(assignment, train_ids, eval_ids, [keys[p] for p in part])

    with atomic_output_dir(out) as tmp:
        for d in dirs:
            (tmp / d).mkdir(parents=True)
        t2 = time.time()
        log.info("shard: one Spark pass writing %d rows into %d directories with %d task(s) (row groups of "
                 "%d rows) ...", int(expected.sum()), len(dirs), tasks, cfg.row_group_rows)
        summary = _spark_pass(spark, in_path, schema, routing, dirs, tmp, cfg.row_group_rows, tasks, tensors)
        errors = [r.error for r in summary if r.error]
        if errors:
            raise BadInputError(f"{in_path}: {errors[0]}")
        log.info("shard: Spark pass done in %.1f s", time.time() - t2)

        files: dict[int, list[str]] = {d: [] for d in range(len(dirs))}
        rows = np.zeros(len(dirs), np.int64)
        for r in summary:
            files[r.dest].append(r.file)
            rows[r.dest] += r.rows
        bad = np.flatnonzero(rows != expected)
        if bad.size:
            d = int(bad[0])
            raise PipelineError(f"shard: {dirs[d]} received {rows[d]} rows, expected {expected[d]} "
                                f"(input changed during the run?)")
        for d, name in enumerate(dirs):  # leftovers of failed task attempts
            keep = set(files[d])
            for f in (tmp / name).iterdir():
                if f.name not in keep:
                    f.unlink()
            if not files[d]:
                files[d].append(_write_empty(tmp / name, output_schema(schema, tensors)))

        manifest = ShardManifest(
            source=str(in_path), layout=LayoutSpec(**layout.to_manifest()), n_train_samples=N,
            row_group_rows=cfg.row_group_rows, eval={s: str(out.child("eval", s)) for s in eval_names},
            tensors={c: TensorSpec(dtype=d, length=k) for c, (d, k) in tensors.items()},
            workers=[WorkerShard(worker=i, path=str(out.child(dirs[i])), files=sorted(files[i]), rows=int(rows[i]),
                                 sample_ids=id_ranges(train_ids[assignment.members[i]]),
                                 seed=assignment.seeds[i], group=assignment.groups[i]) for i in range(M)])
        manifest.write(tmp / MANIFEST_NAME)
    log.info("shard: wrote %d worker directories + eval (%s) to %s in %.1f s", M, ", ".join(eval_names), out,
             time.time() - t0)
    return manifest.model_dump(mode="json")
