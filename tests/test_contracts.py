"""The typed contracts (pipeline.contracts): published JSON Schemas equal the models, and the
models accept what the stages write and reject what they must not."""
from __future__ import annotations

import json

import pytest

from pipeline.contracts import CONTRACTS, CONTRACTS_DIR, json_schema, main, model_of, stale


@pytest.mark.parametrize("name", list(CONTRACTS))
def test_published_schema_equals_the_model(name):
    p = CONTRACTS_DIR / f"{name}.json"
    assert p.is_file(), f"{p} missing: run python -m pipeline.contracts"
    assert json.loads(p.read_text()) == json_schema(name), f"{p} is stale: run python -m pipeline.contracts"


def test_check_names_a_stale_file(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert stale(tmp_path) == []
    first = next(iter(CONTRACTS))
    (tmp_path / f"{first}.json").write_text("{}\n")
    assert main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{first}.json" in err[0]


def test_dag_settings_files_in_configs_are_valid():
    from pathlib import Path

    from pipeline.dag_settings import load_dag_settings

    configs = Path(__file__).resolve().parents[1] / "configs"
    hep = load_dag_settings("hep", configs / "dag_hep.yaml")
    images = load_dag_settings("images", configs / "dag_images.yaml")
    assert isinstance(hep, model_of("dag_hep")) and isinstance(images, model_of("dag_images"))
    assert hep.params.model == "hlf" and images.params.model == "lenet5"


@pytest.mark.parametrize("text,needle", [
    ("params:\n  workers: 0\n", "params.workers"),
    ("params:\n  model: lenet5\n", "params.model"),            # an images model in the HEP DAG
    ("ingest_retries:\n  retry: 3\n", "ingest_retries.retry"),  # misspelt key
    ("start_date: soon\n", "start_date"),
    ("- a\n", "mapping"),
])
def test_bad_dag_settings_name_file_and_key(tmp_path, text, needle):
    from pipeline.dag_settings import load_dag_settings

    p = tmp_path / "dag_hep.yaml"
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        load_dag_settings("hep", p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg and needle in msg, msg
