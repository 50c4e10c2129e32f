"""Credentials never reach a file or a line (pipeline.redact): an input path never expands a
credential's variable, a tracking URI's password is neither remembered, logged nor printed, and a
config (``spark.conf``) is written and printed without its secrets."""
from __future__ import annotations

import json
import logging

import pytest

from pipeline.redact import MASK, expand_path, redact

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def test_redact_configs_uris_and_lines(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    conf = {"spark": {"master": "spark://10.0.0.1:7077", "conf": {
        "spark.hadoop.fs.s3a.secret.key": "abc", "spark.hadoop.fs.s3a.access.key": "AKIAX",
        "spark.authenticate.secret": "s", "spark.sql.shuffle.partitions": "8", "spark.hadoop.fs.s3a.session.token": "",
    }}, "remote": "sc://host:15002/;user_id=me;token=tok123", "tracking": {"uri": "http://bob:pw1@h:5000/x"},
        "input": ["https://h/f.root?X-Amz-Signature=sig1&x=1", f"/data/{SECRET}.root"], "seed": 3, "token_ok": True}
    got = redact(conf)
    assert got["spark"]["conf"] == {"spark.hadoop.fs.s3a.secret.key": MASK, "spark.hadoop.fs.s3a.access.key": MASK,
                                    "spark.authenticate.secret": MASK, "spark.sql.shuffle.partitions": "8",
                                    "spark.hadoop.fs.s3a.session.token": ""}
    assert got["spark"]["master"] == "spark://10.0.0.1:7077"
    assert got["remote"] == f"sc://host:15002/;user_id=me;token={MASK}"
    assert got["tracking"]["uri"] == f"http://bob:{MASK}@h:5000/x"
    assert got["input"] == [f"https://h/f.root?X-Amz-Signature={MASK}&x=1", f"/data/{MASK}.root"]
    assert (got["seed"], got["token_ok"]) == (3, True)
    assert redact("https://ghp_token123@github.com/x") == f"https://{MASK}@github.com/x"
    assert redact("s3://bucket/a@b/c.root root://host:1094//eos/x") == "s3://bucket/a@b/c.root root://host:1094//eos/x"
    assert conf["spark"]["conf"]["spark.hadoop.fs.s3a.secret.key"] == "abc"      # the input is not changed


def test_an_input_path_never_expands_a_credential(tmp_path, monkeypatch, caplog):
    """``/data/$AWS_SECRET_ACCESS_KEY.root``: the variable stays as written in the file list and in
    the bad-file line; other variables are expanded as before."""
    from pipeline.features.plan import plan_units
    from pipeline.features.stage import FeaturesConfig
    from pipeline.ingest.root import resolve_files

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("PIPELINE_TEST_LAND", str(tmp_path / "land"))
    raw = ["/data/$AWS_SECRET_ACCESS_KEY.root", "${PIPELINE_TEST_LAND}/a.root"]
    assert resolve_files(raw) == ["/data/$AWS_SECRET_ACCESS_KEY.root", str(tmp_path / "land" / "a.root")]
    kept = "/$AWS_SECRET_ACCESS_KEY/$UNSET_PIPELINE_VAR"
    assert expand_path("~" + kept).endswith(kept)
    with caplog.at_level(logging.WARNING):
        files, _, _, _ = plan_units(FeaturesConfig(input=raw[:1], output=str(tmp_path / "out")))
    assert [(f.path, f.error) for f in files] == [("/data/$AWS_SECRET_ACCESS_KEY.root", "not found")]
    assert "bad input file /data/$AWS_SECRET_ACCESS_KEY.root: not found" in caplog.text
    assert SECRET not in caplog.text


def test_a_tracking_uri_password_is_never_written_logged_or_printed(tmp_path, monkeypatch, caplog, capsys):
    from pipeline.cli import setup_logging
    from pipeline.errors import ConfigError
    from pipeline.studies.tracking import client, remember_run

    uri = f"http://alice:{SECRET}@127.0.0.1:9/"
    remember_run(tmp_path / "mlflow_run.json", uri, "r1")
    text = (tmp_path / "mlflow_run.json").read_text()
    assert SECRET not in text and json.loads(text)["tracking_uri"] == f"http://alice:{MASK}@127.0.0.1:9/"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with pytest.raises(ConfigError) as e:          # nothing listens on port 9 (discard) of loopback
        client(uri)
    assert "tracking.uri='http://alice:***@127.0.0.1:9/'" in str(e.value) and SECRET not in str(e.value)
    setup_logging()
    with caplog.at_level(logging.INFO):
        logging.getLogger("pipeline.studies.tracking").info("MLflow at %s", uri)
    assert f"MLflow at http://alice:{MASK}@127.0.0.1:9/" in caplog.text and SECRET not in caplog.text


def test_a_dry_run_prints_the_config_without_its_secrets(tmp_path, capsys):
    import yaml

    from jobs.features import main

    cfg = tmp_path / "f.yaml"
    cfg.write_text(yaml.safe_dump({"output": str(tmp_path / "out"), "spark": {"conf": {
        "spark.hadoop.fs.s3a.secret.key": SECRET, "spark.sql.files.maxPartitionBytes": "1m"}}}))
    assert main(["--config", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    conf = json.loads(out)["config"]["spark"]["conf"]
    assert conf == {"spark.hadoop.fs.s3a.secret.key": MASK, "spark.sql.files.maxPartitionBytes": "1m"}
    cfg.write_text(yaml.safe_dump({"output": f"s3://user:{SECRET}@bucket/x"}))
    main(["--config", str(cfg), "--dry-run"])         # printed as the config, or in an error line
    printed = capsys.readouterr()
    assert SECRET not in printed.out + printed.err and f"user:{MASK}@bucket" in printed.out + printed.err


@pytest.mark.slow   # the simulation stage on Spark (4 events; Spark's start-up when no test before started it)
def test_the_simulation_sidecar_holds_no_spark_secret(spark, tmp_path):
    from pipeline.simulate import SimulateConfig
    from pipeline.simulate.stage import generate

    out = tmp_path / "sim"
    generate(SimulateConfig(processes=["ttbar"], events=4, events_per_file=4, seed=1, output=str(out), progress=False,
                            spark={"conf": {"spark.hadoop.fs.s3a.secret.key": SECRET}}), spark=spark)
    side = (out / "simulation.json").read_text()
    assert SECRET not in side
    assert json.loads(side)["config"]["spark"]["conf"] == {"spark.hadoop.fs.s3a.secret.key": MASK}
