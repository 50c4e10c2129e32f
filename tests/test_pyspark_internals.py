"""PySpark's private API is reached in one adapter module only (``pipeline/pyspark_internals.py``),
and the adapter is checked against the real PySpark we pin: when PySpark renames or changes the
internal it uses, these tests fail instead of a training launch on a cluster."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ADAPTER = REPO / "pipeline" / "pyspark_internals.py"
# PySpark's private handles on the JVM and its private module state
_PRIVATE = re.compile(r"\._jsc\b|\._jvm\b|\._gateway\b|\._jsparkSession\b|\b_active_spark_context\b")


def test_only_the_adapter_reaches_pyspark_private_attributes():
    offenders = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        if path == ADAPTER:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PRIVATE.search(code):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "PySpark internals outside pipeline/pyspark_internals.py:\n" + "\n".join(offenders)
    assert ADAPTER.is_file(), "the PySpark adapter module is missing"


def test_max_concurrent_tasks_of_a_real_session(spark):
    """The shared session is local[2] with one CPU per task: the scheduler grants 2 tasks at once."""
    from pipeline.pyspark_internals import max_concurrent_tasks

    assert max_concurrent_tasks(spark.sparkContext) == 2


def test_max_concurrent_tasks_follows_task_cpus(tmp_path):
    """A second application in its own process, local[4] with spark.task.cpus=2: 2 tasks at once
    (an adapter that ignored the resource profile would say 4)."""
    import subprocess
    import sys

    code = ("from pyspark.sql import SparkSession\n"
            "from pipeline.pyspark_internals import max_concurrent_tasks\n"
            "s = (SparkSession.builder.master('local[4]').config('spark.task.cpus', '2')"
            ".config('spark.ui.enabled', 'false').getOrCreate())\n"
            "print('SLOTS', max_concurrent_tasks(s.sparkContext))\n"
            "s.stop()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SLOTS 2" in r.stdout.splitlines(), r.stdout
