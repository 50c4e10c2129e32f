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
