"""hep_pipeline: [simulate] -> ingest ROOT -> features (HLF, LLF) -> shard -> train -> report.

Wiring only: each task runs ``jobs/<job>.py`` with ``configs/<job>.yaml`` and the run-scoped
paths below (``<output_root>/hep_pipeline/<logical date>/<artefact>``); settings and param
defaults come from ``configs/dag_hep.yaml``. With ``simulate`` true the run first generates
events with the simulation stage and ingests those instead of ``input_glob``. See
``spark_jobs.py`` and docs/airflow.md.
"""
from __future__ import annotations

import os
import sys

from airflow.sdk import DAG, Param, task

# the helper module next to this file (Airflow 3 does not put the DAG folder on sys.path everywhere)
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from spark_jobs import DagSettings, common_params, input_path, job_task, stage_paths

DAG_ID = "hep_pipeline"
S = DagSettings("hep", DAG_ID)
P = stage_paths(DAG_ID, ["simulated", "events", "features", "shards", "train", "report"])
INPUT = "{% if params.simulate %}" + P["simulated"] + "/*/*.root{% else %}{{ params.input_glob }}{% endif %}"

with DAG(
    dag_id=DAG_ID,
    description="ROOT -> Parquet -> HLF/LLF features -> per-worker shards -> distributed training -> report",
    **S.dag_kwargs(),
    tags=["spark", "hep"],
    params={
        **common_params(S, {}),
        "simulate": Param(S.params["simulate"], type="boolean",
                          description="generate events with jobs/simulate.py instead of reading input_glob"),
        "input_glob": Param(input_path(S.params["input_glob"]), type="string",
                            description="ROOT files to ingest (path, glob, root:// URL or samples:NAME), "
                                        "when simulate is false"),
        "model": Param(S.params["model"], enum=["hlf", "gru", "inclusive"],
                       description="classifier: hlf (HLF dataset), gru / inclusive (LLF dataset)"),
        "algorithm": Param(S.params["algorithm"], type="string", description="training algorithm"),
        "workers": Param(S.params["workers"], type="integer", minimum=1,
                         description="number of shards / training workers"),
        "scheme": Param(S.params["scheme"], type="string",
                        description="data assignment scheme of jobs/shard.py"),
    },
    doc_md=__doc__,
) as dag:

    @task.branch(task_id="choose_source")
    def choose_source(params=None) -> str:
        """Simulate first, or go straight to ingesting ``input_glob``."""
        return "simulate" if params["simulate"] else "ingest_root"

    branch = choose_source()
    simulate = job_task("simulate", {"output": P["simulated"]}, S, retries="ingest")
    ingest = job_task("ingest_root", {"input": INPUT, "tree": "Delphes", "output": P["events"]}, S, retries="ingest",
                      trigger_rule="none_failed_min_one_success")
    features = job_task("features", {"input": P["events"], "output": P["features"]}, S)
    shard = job_task("shard", {"input": P["features"] + "/{{ 'hlf' if params.model == 'hlf' else 'llf' }}",
                               "output": P["shards"],
                               "workers": "{{ params.workers }}",
                               "scheme": "{{ params.scheme }}"}, S)
    train = job_task("train", {"manifest": P["shards"] + "/manifest.json", "output": P["train"],
                               "model": "{{ params.model }}",
                               "workers": "{{ params.workers }}", "algorithm.name": "{{ params.algorithm }}",
                               "resume": "auto"}, S, retries="train")  # a retry continues from the run's checkpoints
    report = job_task("report", {"runs": [P["train"]], "output": P["report"] + "/learning_curves.png"}, S)
    branch >> [simulate, ingest]
    simulate >> ingest >> features >> shard >> train >> report
