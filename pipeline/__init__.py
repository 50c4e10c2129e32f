"""HEP/image data-and-training pipeline on Apache Spark.

Layers, each importing only the ones before it:

    schemas -> ingest -> features -> shards -> data (readers) -> train

Every stage is a plain Python function taking a typed config (``pipeline.config``);
``jobs/*.py`` and ``airflow_dags/*.py`` are thin wrappers around those functions.
"""

__version__ = "0.1.0"
