"""What a DAG trigger may change (issue 52, item 18): a run's conf may set only the DAG params and the
``extra_sets`` keys the deployment enables in the Airflow Variable ``pipeline_trigger_keys``; any
other key is refused in one line that names it, before a task starts ``spark-submit`` (so a trigger
cannot point ``spark_master`` at its own cluster, whose executors would get our S3 settings).

The rule itself (:func:`pipeline.dag_settings.trigger_refusal`) on plain dicts, and once through a real
``dag.test()`` of ``hep_ingest_daily`` with the Variable given as Airflow reads it from the
environment (``AIRFLOW_VAR_PIPELINE_TRIGGER_KEYS``)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dags_fixtures import REPO, airflow_home, run_airflow  # noqa: F401 (fixture)

DEFAULTS = {"output_root": "/srv/runs", "spark_master": "", "workers": 2,
            "extra_sets": {"features": ["test_fraction=0.25"]}}


def _refusal(conf: dict, allowed) -> str | None:
    from pipeline.dag_settings import trigger_refusal

    return trigger_refusal(conf, DEFAULTS, None if allowed is None else json.dumps(allowed))


def test_a_trigger_may_change_only_what_the_deployment_enables():
    enabled = {"params": ["output_root", "workers"], "extra_sets": {"train": ["epochs"]}}
    # what the deployment enables, and any param or extra --set left at the DAG's default (the trigger
    # form of Airflow's UI sends every param)
    assert _refusal({"output_root": "/tmp/x", "workers": 4, "spark_master": "",
                     "extra_sets": {"train": ["epochs=1"], "features": ["test_fraction=0.25"]}}, enabled) is None
    assert _refusal({}, None) is None
    # the rest is refused in one line naming every key, never its value
    msg = _refusal({"spark_master": "spark://evil.example:7077", "workers": 3,
                    "extra_sets": {"train": ["epochs=1", "spark.master=spark://evil.example:7077"],
                                   "features": ["s3.secret_key=x"]}}, enabled)
    assert msg is not None and "\n" not in msg, msg
    for key in ("spark_master", "extra_sets.train: spark.master", "extra_sets.features: s3.secret_key"):
        assert key in msg, msg
    assert "evil" not in msg and "workers" not in msg.split("refused")[1].split("(")[0], msg
    assert "pipeline_trigger_keys" in msg, msg
    # nothing enabled (the Variable unset): a trigger may change nothing
    assert "output_root" in (_refusal({"output_root": "/tmp/x"}, None) or "")
    # an item that is not key=value, and a task's sets that are not a list of strings
    assert "extra_sets.train" in (_refusal({"extra_sets": {"train": ["epochs"]}}, enabled) or "")
    assert "extra_sets" in (_refusal({"extra_sets": ["epochs=1"]}, enabled) or "")
    # a deployment that trusts every triggerer says so
    assert _refusal({"spark_master": "local[1]", "extra_sets": {"x": ["a.b=1"]}},
                    {"params": ["*"], "extra_sets": {"*": ["*"]}}) is None


def test_a_malformed_variable_is_one_line_naming_it():
    from pipeline.dag_settings import trigger_refusal

    for bad in ("not json", json.dumps(["spark_master"]), json.dumps({"params": "spark_master"}),
                json.dumps({"params": [], "sets": {}})):
        msg = trigger_refusal({"workers": 3}, DEFAULTS, bad)
        assert msg is not None and "\n" not in msg and "Airflow Variable pipeline_trigger_keys" in msg, (bad, msg)


# slow (about 40 s on 2 busy cores): an Airflow subprocess imports Airflow, parses the DAG folder and runs
# dag.test(); nothing cheaper runs a task's execute with a real DAG run's conf and the Variable as Airflow
# reads it. The refused task fails before its spark-submit; the two downstream tasks are marked successful.
@pytest.mark.slow
def test_a_dag_run_whose_conf_sets_spark_master_is_refused_before_spark_submit(airflow_home, tmp_path):
    cfg = tmp_path / "configs"     # no retries: a run that is not refused fails at once (no input file)
    shutil.copytree(REPO / "configs", cfg)
    d = yaml.safe_load((cfg / "dag_hep_ingest_daily.yaml").read_text())
    d["ingest_retries"]["retries"] = 0
    (cfg / "dag_hep_ingest_daily.yaml").write_text(yaml.safe_dump(d))
    enabled = {"params": ["output_root", "landing", "table"]}
    conf = {"output_root": str(tmp_path / "runs"), "landing": str(tmp_path / "landing" / "*" / "*.root"),
            "table": str(tmp_path / "table"), "spark_master": "local[1]"}
    res = run_airflow(airflow_home, "hep_ingest_daily", "2026-11-01T00:00:00+00:00", conf=conf, timeout=600,
                      mark_success="^(features|shard)$",
                      extra_env={"AIRFLOW_VAR_PIPELINE_TRIGGER_KEYS": json.dumps(enabled),
                                 "PIPELINE_DAG_CONFIG_DIR": str(cfg)})
    assert res["tasks"]["ingest_root"].endswith("failed"), res
    log = Path(res["log"]).read_text(errors="replace")
    lines = {ln[ln.index("DAG trigger refused"):] for ln in log.splitlines() if "DAG trigger refused" in ln}
    assert len(lines) == 1, log[-4000:]
    line = lines.pop()
    refused = line.split(" (Airflow Variable")[0]
    assert "spark_master" in refused and "output_root" not in refused and "local[1]" not in line, line
    assert "spark-submit /" not in log, "the refused task started spark-submit"
    assert not (tmp_path / "table").exists()
