"""Reading a committed Parquet dataset in Spark tasks through ``pyarrow.fs``, without Hadoop's
S3A connector.

``spark.read.parquet("s3a://...")`` needs the ``hadoop-aws`` jar and its settings on every node;
a stock PySpark has neither. These helpers list a committed dataset on the driver (the files of
its ``_COMPLETE`` marker on an object store, :func:`pipeline.commit.committed_files`) and read the
files in the tasks with pyarrow, with the S3 settings of the executors' environment
(:mod:`pipeline.fs`):

* :func:`dataset_files`: the data files' URIs (plain strings, for task descriptors);
* :func:`read_parquet`: one file as a pyarrow Table, in a task or anywhere;
* :func:`parquet_frame`: a Spark DataFrame of the dataset's rows (one task per group of files),
  for stages that go on with Spark's own operators. Where a cluster has the S3A connector,
  ``spark.read.parquet(Location.spark_uri())`` reads the same files.
"""
from __future__ import annotations

import functools
import os
from typing import Iterator, Optional, Sequence

from .committed import committed_files
from .errors import BadInputError, ConfigError
from .fs import Location, error_reason, location
from .spark import forward_s3_settings, spark_task, task_frame
from .tables.snapshot import check_one_run, is_delta_table, snapshot_files


def dataset_files(path: str | os.PathLike | Location, suffix: str = ".parquet", what: str = "input",
                  version: Optional[int] = None) -> list[str]:
    """The URIs of a committed dataset's data files, sorted; BadInputError when it has none. A
    Delta table: the files of its snapshot (the newest, or ``version``), never a listing; the
    newest only when the tables written with it are of the same run (``check_one_run``)."""
    if is_delta_table(path):
        if version is None:
            check_one_run(path)
        uris = snapshot_files(path, version)
        if not uris:
            raise BadInputError(f"{what} {location(path)} (Delta table) holds no data files at version "
                                f"{'latest' if version is None else version}")
        return uris
    if version is not None:
        raise ConfigError(f"{what} {location(path)}: a version (time travel) needs a Delta table, and this is not one")
    files = committed_files(path, suffix, what)
    if not files:
        raise BadInputError(f"{what} {location(path)} holds no {suffix or 'data'} files")
    return [str(f) for f in files]


def read_parquet(path: str | os.PathLike | Location, columns: Optional[Sequence[str]] = None):
    """One Parquet file through ``pyarrow.fs`` (local or ``s3://``); a missing or unreadable file
    is one line naming it."""
    import pyarrow.parquet as pq

    loc = location(path)
    try:
        with loc.filesystem().open_input_file(loc.path) as f:
            return pq.read_table(f, columns=list(columns) if columns is not None else None)
    except FileNotFoundError:
        raise BadInputError(f"{loc}: not found") from None
    except OSError as e:
        raise BadInputError(f"{loc}: {error_reason(e)}") from None
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise BadInputError(f"{loc}: unreadable Parquet file ({' '.join(str(e).split())[:200]})") from None


def parquet_schema_of(path: str | os.PathLike | Location):
    """The Arrow schema of one Parquet file (its footer only)."""
    import pyarrow.parquet as pq

    loc = location(path)
    try:
        with loc.filesystem().open_input_file(loc.path) as f:
            return pq.read_schema(f)
    except Exception as e:  # noqa: BLE001
        raise BadInputError(f"{loc}: unreadable Parquet file ({' '.join(str(e).split())[:200]})") from None


def _read_files(batches: Iterator, *, columns: Optional[list[str]], schema_bytes: bytes,
                file_column: Optional[str]) -> Iterator:
    """Task: the rows of each file of the descriptors (``file_index``, ``uri``), batch by batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    for batch in batches:
        d = batch.to_pydict()
        for fi, uri in zip(d["file_index"], d["uri"]):
            loc = location(uri)
            with loc.filesystem().open_input_file(loc.path) as f:
                reader = pq.ParquetFile(f)
                for b in reader.iter_batches(columns=columns):
                    if file_column:
                        b = pa.RecordBatch.from_arrays([*b.columns, pa.array([fi] * b.num_rows, pa.int32())],
                                                       names=[*b.schema.names, file_column])
                    yield from pa.Table.from_batches([b]).cast(schema).to_batches()


def parquet_frame(spark, path: str | os.PathLike | Location, columns: Optional[Sequence[str]] = None,
                  files_per_task: int = 1, file_column: Optional[str] = None, version: Optional[int] = None):
    """A DataFrame of a committed Parquet dataset (or a Delta table's snapshot at ``version``), read
    in the tasks through ``pyarrow.fs`` (``files_per_task`` consecutive files per task;
    ``file_column``: adds each row's file index in :func:`dataset_files` order). The schema is the
    first file's (its footer, read here)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    files = dataset_files(path, version=version)
    if not location(path).is_local:
        forward_s3_settings(spark)
    schema = parquet_schema_of(files[0])
    if columns is not None:
        missing = [c for c in columns if schema.get_field_index(c) < 0]
        if missing:
            raise BadInputError(f"{location(path)}: no column {missing[0]!r} (columns: {', '.join(schema.names)})")
        schema = pa.schema([schema.field(c) for c in columns])
    schema = pa.schema([f.remove_metadata() for f in schema])
    if file_column:
        schema = schema.append(pa.field(file_column, pa.int32()))
    per = max(1, int(files_per_task))
    desc = task_frame(spark, [(i, u) for i, u in enumerate(files)], "file_index int, uri string",
                      tasks=[i // per for i in range(len(files))])
    body = functools.partial(_read_files, columns=list(columns) if columns is not None else None,
                             schema_bytes=schema.serialize().to_pybytes(), file_column=file_column)
    return desc.mapInArrow(spark_task(body), from_arrow_schema(schema))
