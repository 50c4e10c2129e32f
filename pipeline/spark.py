"""SparkSession factory: ``local[*]`` by default, any master from config or spark-submit."""
from __future__ import annotations

import os
import sys
from typing import Optional

from .config import SparkConfig


def _launched_by_spark_submit() -> bool:
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_spark(cfg: Optional[SparkConfig] = None):
    """Return the active SparkSession, or start one from ``cfg``.

    Under ``spark-submit`` the master and resources come from the command line unless
    ``cfg.master`` is set explicitly. From plain Python the default is ``local[*]``.
    Executors use this interpreter (``PYSPARK_PYTHON``) so the virtualenv is shared.
    """
    from pyspark.sql import SparkSession

    cfg = cfg or SparkConfig()
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    b = SparkSession.builder.appName(cfg.app_name)
    if cfg.master:
        b = b.master(cfg.master)
    elif not _launched_by_spark_submit():
        b = b.master("local[*]")
    settings = {
        "spark.sql.shuffle.partitions": str(cfg.shuffle_partitions),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        "spark.ui.enabled": "false",
        "spark.sql.parquet.compression.codec": "snappy",
    }
    if not _launched_by_spark_submit():
        settings["spark.driver.memory"] = cfg.driver_memory
    settings.update(cfg.conf)
    for k, v in settings.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# --------------------------------------------------------------------------------------------
# Python worker start-up cost
# --------------------------------------------------------------------------------------------

def python_worker_setup() -> None:
    """Make the following tasks of this Spark Python worker start fast (idempotent, cheap).

    PySpark 4.0 calls ``importlib.invalidate_caches()`` at the start of every Python task
    (``worker_util.setup_spark_files``). Since Python 3.10 that makes every ``zipimporter`` on
    ``sys.path`` re-read its whole archive directory, and the worker imports PySpark itself from
    ``pyspark.zip`` and ``py4j-*.zip`` (16 importers): measured here at 0.35 CPU-s per task,
    about a third of the time it takes to convert one Delphes file, so a stage of many small
    tasks spent a large part of its CPU re-reading zip directories. Apache Spark fixed this
    after 4.0 (SPARK-54744, "only invalidate cache when necessary"); this is the same fix for
    the Spark we pin: an archive is re-read only when its size or modification time changed.
    The patch lives in the worker process, which Spark reuses, so it pays off from the second
    task of each worker on. Every ``mapInArrow``/RDD function of the pipeline calls it, through
    :func:`spark_task`.
    """
    import zipimport

    cls = zipimport.zipimporter
    if getattr(cls, "_pipeline_stat_guard", False) or not hasattr(cls, "invalidate_caches"):
        return
    original = cls.invalidate_caches

    def invalidate_caches(self):
        try:
            st = os.stat(self.archive)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp is not None and getattr(self, "_pipeline_stamp", None) == stamp:
            return
        self._pipeline_stamp = stamp
        original(self)

    cls.invalidate_caches = invalidate_caches
    cls._pipeline_stat_guard = True


def spark_task(fn):
    """Decorator for the functions the pipeline hands to ``mapInArrow`` / RDD ``map``:
    runs :func:`python_worker_setup` in the worker before the task's own work."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        python_worker_setup()
        return fn(*args, **kwargs)

    return wrapper


def task_frame(spark, rows: list[tuple], schema):
    """A DataFrame of small task descriptors, exactly one row per partition, built without a
    Python worker (so Spark runs one Python task per descriptor, balanced over the executors).

    ``spark.createDataFrame(sc.parallelize(rows), schema)`` would run a second Python task per
    partition just to convert the pickled rows (each paying the worker start-up cost described
    in :func:`python_worker_setup`); here the descriptors travel to the JVM as one Arrow table
    and are broadcast-joined onto ``spark.range(n, numPartitions=n)``, whose partitions hold
    one id each. ``schema`` is a ``StructType`` or a DDL string matching the tuples.
    """
    import pandas as pd
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StructField, StructType

    if not isinstance(schema, StructType):
        schema = StructType.fromDDL(schema)
    with_id = StructType([StructField("_task", LongType(), False), *schema.fields])
    pdf = pd.DataFrame([(i, *r) for i, r in enumerate(rows)], columns=with_id.fieldNames())
    desc = spark.createDataFrame(pdf, schema=with_id)
    n = max(1, len(rows))
    return (spark.range(0, n, 1, n).join(F.broadcast(desc), F.col("id") == F.col("_task"))
            .drop("id", "_task"))
