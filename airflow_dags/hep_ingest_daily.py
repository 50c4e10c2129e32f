"""hep_ingest_daily: the landing folder's new ROOT files -> the Delta table -> the day's features
and shards, built from the table's snapshot.

Wiring only: ``ingest_root`` runs with ``output_format=delta`` and ``mode=new_files`` on the
``landing`` glob, so each run reads only the files the table does not hold yet (a day with none
is a no-op that says so in one line; a landed file that fails in ``quarantine_after`` attempts is
quarantined and skipped, so the day goes on with what was committed); ``features`` reads the table's newest snapshot (every file
ingested so far, through the Delta log) and ``shard`` its HLF (or LLF) dataset, into this run's
folder ``<output_root>/hep_ingest_daily/<logical date>/``. Settings and param defaults come from
``configs/dag_hep_ingest_daily.yaml``. See ``spark_jobs.py``, docs/airflow.md and
docs/ingestion.md#the-daily-recipe.
"""
from __future__ import annotations

import os
import sys

from airflow.sdk import DAG, Param

# the helper module next to this file (Airflow 3 does not put the DAG folder on sys.path everywhere)
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from spark_jobs import DagSettings, common_params, input_path, job_task, stage_paths

DAG_ID = "hep_ingest_daily"
S = DagSettings("hep_ingest_daily", DAG_ID)
P = stage_paths(DAG_ID, ["features", "shards"])

with DAG(
    dag_id=DAG_ID,
    description="landing folder -> Delta table (only new files) -> features and shards from the table's snapshot",
    **S.dag_kwargs(),
    tags=["spark", "hep", "delta"],
    params={
        **common_params(S, {}),
        "landing": Param(input_path(S.params["landing"]), type="string",
                         description="glob of the landing folder or bucket prefix"),
        "table": Param(input_path(S.params["table"]), type="string", description="the Delta table"),
        "tree": Param(S.params["tree"], type="string", description="TTree or RNTuple name"),
        "on_changed": Param(S.params["on_changed"], enum=["skip", "replace", "fail"],
                            description="a landed file that changed since it was ingested"),
        "quarantine_after": Param(S.params["quarantine_after"], type="integer", minimum=0,
                                  description="ingest attempts a landed file may fail before it is quarantined"),
        "model": Param(S.params["model"], enum=["hlf", "gru", "inclusive"],
                       description="hlf: shard the HLF dataset; gru / inclusive: the LLF dataset"),
        "workers": Param(S.params["workers"], type="integer", minimum=1, description="number of shards"),
        "scheme": Param(S.params["scheme"], type="string", description="data assignment scheme of jobs/shard.py"),
    },
    doc_md=__doc__,
) as dag:
    ingest = job_task("ingest_root", {"input": "{{ params.landing }}", "tree": "{{ params.tree }}",
                                      "output": "{{ params.table }}", "output_format": "delta",
                                      "mode": "new_files", "on_changed": "{{ params.on_changed }}",
                                      "quarantine_after": "{{ params.quarantine_after }}"},
                      S, retries="ingest")
    features = job_task("features", {"input": "{{ params.table }}", "tree": "{{ params.tree }}",
                                     "output": P["features"]}, S)
    shard = job_task("shard", {"input": P["features"] + "/{{ 'hlf' if params.model == 'hlf' else 'llf' }}",
                               "output": P["shards"], "workers": "{{ params.workers }}",
                               "scheme": "{{ params.scheme }}"}, S)
    ingest >> features >> shard
