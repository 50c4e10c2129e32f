"""SparkSession factory: ``local[*]`` by default, any master from config or spark-submit."""
from __future__ import annotations

import os
import re
import sys
from typing import Optional

from .config import SparkConfig
from .errors import ConfigError

_LOCAL = re.compile(r"^local(?:\[(\*|\d+)(?:,(\d+))?\])?$")


def _launched_by_spark_submit() -> bool:
    return "PYSPARK_GATEWAY_PORT" in os.environ


def local_master(master: str, min_task_slots: Optional[int]) -> str:
    """``master`` with at least ``min_task_slots`` task slots when it is a ``local`` master
    (``local[*]`` on 2 cores with 4 slots wanted -> ``local[4]``); any other master unchanged."""
    m = _LOCAL.match(master.strip())
    if not m or not min_task_slots:
        return master
    n = 1 if m.group(1) is None else (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
    if n >= min_task_slots:
        return master
    return f"local[{min_task_slots}" + (f",{m.group(2)}]" if m.group(2) else "]")


def get_spark(cfg: Optional[SparkConfig] = None, min_task_slots: Optional[int] = None):
    """Return the active SparkSession, or start one from ``cfg``.

    Under ``spark-submit`` the master and resources come from the command line unless
    ``cfg.master`` is set explicitly. From plain Python the default is ``local[*]``.
    A local master started here gets at least ``min_task_slots`` task slots (training starts
    one task per worker, all at once). Executors use this interpreter (``PYSPARK_PYTHON``) so
    the virtualenv is shared.
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
        b = b.master(local_master(cfg.master, min_task_slots))
    elif not _launched_by_spark_submit():
        b = b.master(local_master("local[*]", min_task_slots))
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


def task_slots(spark) -> int:
    """Tasks the session can run at once: the cores of a local master divided by
    ``spark.task.cpus``; on a cluster, Spark's own count over the registered executors."""
    sc = spark.sparkContext
    conf = sc.getConf()
    cpus = max(1, int(conf.get("spark.task.cpus", "1")))
    m = _LOCAL.match(sc.master)
    if not m:   # what the scheduler would grant a barrier stage now (executor cores / task cpus, GPUs)
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    cores = 1 if m.group(1) is None else (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
    return max(0, cores // cpus)


def _seconds(value: str) -> float:
    """A Spark time setting ("30s", "2min", "500ms", "45") in seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|min|m|h)?\s*", str(value))
    if not m:
        return 30.0
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, None: 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}[m.group(2)]


def check_task_slots(spark, workers: int, wait_s: Optional[float] = None) -> int:
    """The session's task slots; ConfigError when fewer than ``workers`` (training runs one task
    per worker at the same time and would otherwise wait for a start timeout).

    A local master's slots are known at once. On a cluster, executors register after the session
    starts, so the check waits for them up to ``wait_s`` (default: Spark's own
    ``spark.scheduler.maxRegisteredResourcesWaitingTime``, 30 s) before failing.
    """
    import time

    slots = task_slots(spark)
    if slots < workers and not _LOCAL.match(spark.sparkContext.master):
        if wait_s is None:
            conf = spark.sparkContext.getConf().get("spark.scheduler.maxRegisteredResourcesWaitingTime", "30s")
            wait_s = _seconds(conf)
        deadline = time.monotonic() + wait_s
        while slots < workers and time.monotonic() < deadline:
            time.sleep(0.5)
            slots = task_slots(spark)
    if slots < workers:
        raise ConfigError(f"workers={workers} needs {workers} Spark task slots running at once, but the session "
                          f"({spark.sparkContext.master}) has {slots}; lower workers or give Spark more cores "
                          f"(e.g. --master local[{workers}] or more executors)")
    return slots


def forward_s3_settings(spark) -> None:
    """Give the Python tasks started from now on the driver's S3 settings (the variables of
    :data:`pipeline.fs.S3_ENV_VARS` set on the driver), as ``spark.executorEnv.<NAME>`` does at
    start-up: a stage whose tasks read or write ``s3://`` calls it before running them. A changed
    value starts new Python workers (Spark keys its workers by their environment)."""
    from .fs import S3_ENV_VARS

    env = spark.sparkContext.environment
    for name in S3_ENV_VARS:
        value = os.environ.get(name)
        if value is not None and env.get(name) != value:
            env[name] = value


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


def task_frame(spark, rows: list[tuple], schema, tasks: Optional[list[int]] = None):
    """A DataFrame of small task descriptors, exactly one row per partition, built without a
    Python worker (so Spark runs one Python task per descriptor, balanced over the executors).
    ``tasks``: the task (partition) index of each row instead, ``0 .. k-1`` in row order: rows
    with the same index run in one task, in their order (small work units packed together, so
    that each pays Spark's per-task cost once).

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
    ids = list(range(len(rows))) if tasks is None else [int(t) for t in tasks]
    if len(ids) != len(rows):
        raise ValueError(f"task_frame: {len(ids)} task indices for {len(rows)} rows")
    pdf = pd.DataFrame([(i, *r) for i, r in zip(ids, rows)], columns=with_id.fieldNames())
    desc = spark.createDataFrame(pdf, schema=with_id)
    n = max(1, max(ids, default=0) + 1)
    return (spark.range(0, n, 1, n).join(F.broadcast(desc), F.col("id") == F.col("_task"))
            .drop("id", "_task"))
