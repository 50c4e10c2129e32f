"""The one module that reaches PySpark's private API.

PySpark has no public call for "how many tasks can the cluster run at once"; the scheduler knows
it (``SparkContext.maxNumConcurrentTasks`` of the default resource profile: executor cores divided
by ``spark.task.cpus``, GPUs and other task resources included), and PySpark's own barrier and
TorchDistributor code asks it through the private JVM handle ``SparkContext._jsc``. Everything
else in ``pipeline/`` uses public PySpark only; ``tests/test_pyspark_internals.py`` checks that,
and checks this adapter against the pinned PySpark, so a change of the internal fails there.
"""
from __future__ import annotations


def max_concurrent_tasks(sc) -> int:
    """Tasks the scheduler of SparkContext ``sc`` would run at once now, over the registered
    executors (what a barrier stage of the default resource profile can get)."""
    jsc = sc._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))


def connect_session(url: str, options: dict):
    """A Spark Connect client session of the server at ``url`` (``sc://host:port``), with the
    runtime settings ``options`` (static ones are ignored, as Spark Connect's own builder does).

    ``SparkSession.builder.remote(url)`` refuses when this process also runs a classic
    SparkContext (``SESSION_ALREADY_EXIST``); Spark Connect's own builder does not. Like
    ``builder.remote``, it marks the process as a Spark Connect client (the environment variable
    ``SPARK_CONNECT_MODE_ENABLED`` that ``pyspark.sql.utils.is_remote`` reads): from then on
    ``pyspark.sql.functions`` build Spark Connect columns and ``SparkSession.getActiveSession``
    returns this session."""
    import os

    from pyspark.sql.connect.session import SparkSession as ConnectSession

    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    return ConnectSession.builder.remote(url).config(map=options).getOrCreate()
