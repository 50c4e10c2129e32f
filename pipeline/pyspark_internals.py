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
