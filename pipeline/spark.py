"""SparkSession factory: ``local[*]`` by default, any master from config or spark-submit, or a
Spark Connect server (``spark.remote``).

The data stages (ingestion, features, shards) run on either kind of session: they use the
DataFrame API only (``mapInArrow``, ``createDataFrame``, ``range``), and ask this module, never
the SparkContext, for what they need to know of the session (:func:`default_parallelism`,
:func:`check_executor_python`). The training launchers need a classic session
(:func:`require_classic`).
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Optional

from .config import SparkConfig, option_hint
from .errors import ConfigError

_LOCAL = re.compile(r"^local(?:\[(\*|\d+)(?:,(\d+))?\])?$")
#: Spark's logging from the start of a JVM that get_spark starts (spark-submit's JVM reads it from
#: the virtualenv's Spark conf/, see scripts/spark_launchers.sh)
LOG4J_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "log4j2.properties"
#: what every Python task of the pipeline imports on the executors
EXECUTOR_MODULES = ("numpy", "pandas", "pyarrow", "pipeline")
log = logging.getLogger(__name__)


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext, no RDD)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def require_classic(spark, what: str) -> None:
    """ConfigError, one line, when ``spark`` is a Spark Connect session: ``what`` needs a classic one."""
    if is_connect(spark):
        raise ConfigError(f"{what} needs a classic Spark session (it runs barrier tasks through the "
                          f"SparkContext), not Spark Connect; unset spark.remote (and SPARK_REMOTE) and "
                          f"use spark.master, or choose a launcher that runs without Spark (local)")


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
    the virtualenv is shared; :func:`check_executor_python` checks that they can. Spark logs at
    ``cfg.log_level`` (WARN by default) from the start of a JVM started here.

    ``cfg.remote`` (else PySpark's ``SPARK_REMOTE`` variable) makes it a Spark Connect session
    instead (:func:`_connect`); ``cfg.master`` is then not used.
    """
    from pyspark.sql import SparkSession

    cfg = cfg or SparkConfig()
    remote = cfg.remote or os.environ.get("SPARK_REMOTE")
    active = SparkSession.getActiveSession()
    if active is not None and not (remote and not is_connect(active)):
        check_executor_python(active)
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
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
    settings["spark.log.level"] = cfg.log_level.upper()   # applied when the SparkContext starts
    settings.update(cfg.conf)
    if not _launched_by_spark_submit() and LOG4J_CONFIG.is_file():
        java = settings.get("spark.driver.extraJavaOptions", "")
        if "log4j2.configurationFile" not in java:
            settings["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG} {java}".strip()
    if remote:
        spark = _connect(remote, cfg, settings)
    else:
        b = SparkSession.builder.appName(cfg.app_name)
        if cfg.master:
            b = b.master(local_master(cfg.master, min_task_slots))
        elif not _launched_by_spark_submit():
            b = b.master(local_master("local[*]", min_task_slots))
        for k, v in settings.items():
            b = b.config(k, v)
        spark = b.getOrCreate()   # Spark Connect all the same where spark.api.mode says so (PySpark 4.1+)
        if not is_connect(spark):
            spark.sparkContext.setLogLevel(cfg.log_level.upper())
    check_executor_python(spark)
    return spark


def _connect(url: str, cfg: SparkConfig, settings: dict):
    """A Spark Connect session for ``url`` (``cfg.remote`` or ``SPARK_REMOTE``). ``local[N]``
    starts a Connect server in this process (``SparkSession.builder.remote``: a JVM with that
    master, started with ``settings``, log level included); ``sc://host:port`` connects to a
    running server, with the runtime (SQL) settings of ``settings`` for this session (the
    server's own settings stay as they are)."""
    from pyspark.errors import PySparkException
    from pyspark.sql import SparkSession

    url = url.strip()
    if url.startswith("sc://"):
        from .pyspark_internals import connect_session

        runtime = {k: v for k, v in settings.items() if k.startswith("spark.sql.") or k in cfg.conf}
        return connect_session(url, {"spark.app.name": cfg.app_name, **runtime})
    b = SparkSession.builder.remote(url).appName(cfg.app_name)
    for k, v in settings.items():
        b = b.config(k, v)
    try:
        # the server starts with every setting; PySpark 4.0 then also sets the static ones on the
        # client session, which the server refuses with a warning each
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to set spark", category=UserWarning)
            return b.getOrCreate()
    except PySparkException as e:
        if "SESSION_ALREADY_EXIST" not in str(e) and "SESSION_OR_CONTEXT_EXISTS" not in str(e):
            raise
        raise ConfigError(f"spark.remote={url} starts a Spark Connect server in this process, which already "
                          f"runs a classic Spark session; connect to a running server instead "
                          f"({option_hint('spark.remote', 'sc://host:15002')})") from None


_CHECKED_APPS: set[str] = set()


def _app_id(spark) -> str:
    """The Spark application of a session, by kind (the Spark Connect sessions of one server share
    its application, and are checked once apart from a classic session of the same application)."""
    app = spark.conf.get("spark.app.id", None) or f"session-{id(spark)}"
    return f"connect:{app}" if is_connect(spark) else app


def check_executor_python(spark) -> None:
    """ConfigError, one line, when the executors' Python cannot run the pipeline's tasks: it lacks
    one of :data:`EXECUTOR_MODULES` (or cannot start). It names ``PYSPARK_PYTHON`` and the
    interpreter found. One tiny Spark job per application (a success is remembered), run at the
    first stage or data-source call, so a worker never fails later with a ``ModuleNotFoundError``.
    The probe is a plain (pickled, not Arrow) Python UDF over a one-row DataFrame, so it runs on a
    classic and a Spark Connect session alike (there on the server's executors) and reports a
    missing pyarrow instead of failing on it."""
    app = _app_id(spark)
    if app in _CHECKED_APPS:
        return
    from pyspark.sql import functions as F

    wanted = EXECUTOR_MODULES

    def probe(_):   # a closure: pickled by value, so it runs on an executor without this project
        import importlib.util
        import platform
        import sys as _sys

        return [_sys.executable, platform.python_version(),
                ",".join(m for m in wanted if importlib.util.find_spec(m) is None)]

    given = os.environ.get("PYSPARK_PYTHON")
    if is_connect(spark):   # the server starts the Python workers, with its own environment
        what = "the Spark Connect server's Python workers"
        fix = "set PYSPARK_PYTHON of the Spark Connect server to a Python with the project installed"
    else:
        exe = getattr(spark.sparkContext, "pythonExec", None) or given or "python3"
        what = f"PYSPARK_PYTHON={given}" if given else f"PYSPARK_PYTHON is not set, so Spark runs {exe!r}"
        fix = f"set PYSPARK_PYTHON to the project's interpreter (e.g. PYSPARK_PYTHON={sys.executable})"
        spark.sparkContext.setJobDescription("pipeline: the executors' Python")
    try:
        found = spark.range(0, 1, 1, 1).select(F.udf(probe, "array<string>", useArrow=False)("id")).collect()
    except Exception as e:  # noqa: BLE001 - the worker could not start or run at all
        from .cli import root_cause

        raise ConfigError(f"the Spark executors cannot run Python ({what}): {root_cause(e)[:300]}; {fix}") from None
    finally:
        if not is_connect(spark):
            spark.sparkContext.setJobDescription(None)
    path, version, missing = found[0][0]
    if missing:
        raise ConfigError(f"the Spark executors run {path} (Python {version}; {what}), which lacks "
                          f"{missing.replace(',', ', ')}; {fix}")
    _CHECKED_APPS.add(app)


def default_parallelism(spark) -> int:
    """How many tasks a stage cuts its work into: Spark's default parallelism, on either kind of
    session. Classic: the SparkContext's ``defaultParallelism``. Spark Connect (no SparkContext):
    the server's ``spark.default.parallelism`` when set, else the cores of its local master
    (``local[N]``; ``local[*]``: this machine's), else the executors' cores
    (``spark.executor.instances`` x ``spark.executor.cores``, or ``spark.cores.max``), else the
    session's ``spark.sql.shuffle.partitions`` (``spark.shuffle_partitions``)."""
    if not is_connect(spark):
        return spark.sparkContext.defaultParallelism
    conf = spark.conf

    def num(key: str) -> int:
        v = conf.get(key, None)
        return int(v) if v and str(v).strip().isdigit() else 0

    if num("spark.default.parallelism"):
        return num("spark.default.parallelism")
    m = _LOCAL.match(conf.get("spark.master", None) or "")
    if m:
        return max(1, 1 if m.group(1) is None else (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1)))
    cores = num("spark.executor.instances") * num("spark.executor.cores") or num("spark.cores.max")
    return max(1, cores or num("spark.sql.shuffle.partitions") or 2)


def task_slots(spark) -> int:
    """Tasks the session can run at once: the cores of a local master divided by
    ``spark.task.cpus``; on a cluster, Spark's own count over the registered executors. A classic
    session only (training): ConfigError on Spark Connect."""
    require_classic(spark, "training on Spark (launchers horovod and torch)")
    sc = spark.sparkContext
    conf = sc.getConf()
    cpus = max(1, int(conf.get("spark.task.cpus", "1")))
    m = _LOCAL.match(sc.master)
    if not m:   # what the scheduler would grant a barrier stage now (executor cores / task cpus, GPUs)
        from .pyspark_internals import max_concurrent_tasks

        return max_concurrent_tasks(sc)
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
                          f"(e.g. {option_hint('spark.master', f'local[{workers}]')} or more executors)")
    return slots


def forward_s3_settings(spark) -> None:
    """Give the Python tasks started from now on the driver's S3 settings (the variables of
    :data:`pipeline.fs.S3_ENV_VARS` set on the driver), as ``spark.executorEnv.<NAME>`` does at
    start-up: a stage whose tasks read or write ``s3://`` calls it before running them. A changed
    value starts new Python workers (Spark keys its workers by their environment)."""
    from .fs import S3_ENV_VARS

    if is_connect(spark):   # no SparkContext: the server's executors have the server's environment
        if any(os.environ.get(n) is not None for n in S3_ENV_VARS):
            log.info("Spark Connect: the tasks read and write s3:// with the S3 settings of the server's "
                     "environment, not this client's")
        return
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
    runs :func:`python_worker_setup` in the worker before the task's own work. Applied on the
    driver, it first checks the executors' Python of the active session
    (:func:`check_executor_python`, once per application)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        python_worker_setup()
        return fn(*args, **kwargs)

    _check_active_session()   # on the driver, where the stage hands ``wrapper`` to Spark
    return wrapper


def _check_active_session() -> None:
    """:func:`check_executor_python` for the session a stage runs on, also one the caller built."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return
    active = SparkSession.getActiveSession()
    if active is not None:
        check_executor_python(active)


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
