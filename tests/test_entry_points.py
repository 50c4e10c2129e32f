"""How a job starts, as a new user starts it (a new shell: tests/shell_fixtures.py):

* Spark's own logging is at WARN for every way a job starts (the virtualenv's ``spark-submit``
  without activation, ``python -m jobs.X``), without a flag; ``--verbose`` brings Spark's INFO
  lines back;
* a Spark session whose executors run a Python without the project's dependencies is stopped at
  the first stage or data-source call with one line naming ``PYSPARK_PYTHON`` and the
  interpreter found, never a ``ModuleNotFoundError`` from inside a worker;
* an error names the flag or key of the entry point the user called (``--spark.master`` for
  ``python -m``, ``--master`` for ``spark-submit``, ``SparkConfig(master=...)`` from Python, the
  DAG param under Airflow).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from shell_fixtures import REPO, VENV_BIN, activated_env, clean_env, lines, sh, spark_info_lines

# e2e and slow: the tests that start a job in a new shell. Each such process starts its own JVM
# (spark-submit, or the job's own Spark session) and a fresh interpreter, which is what is under test,
# so none can share the suite's session; one job per entry point and what it shows. The checks that
# run in this process are in the fast tier.

DIGITS = ["--source", "sklearn_digits", "--limit", "120"]


def _job(how: str, job: str, args: list[str], master: str = "local[1]") -> list[str]:
    if how == "spark-submit":
        return [str(VENV_BIN / "spark-submit"), "--master", master, str(REPO / "jobs" / f"{job}.py"), *args]
    return [str(VENV_BIN / "python"), "-m", f"jobs.{job}", "--spark.master", master, *args]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("how", ["spark-submit", "python -m"])
def test_spark_logs_at_warn(how, tmp_path):
    """Without a flag, no Spark INFO line. (``--verbose`` bringing them back, from each entry point:
    the slot-error runs below, which start the same Spark session and stop right after.)"""
    out = tmp_path / "digits"
    r = sh(_job(how, "ingest_images", [*DIGITS, "--output", str(out)]), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    info = spark_info_lines(r.stderr + r.stdout)
    assert info == [], f"{len(info)} Spark INFO lines, e.g. {info[:3]}"
    assert (out / "_ingest.json").is_file()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("command,activated", [
    (".venv/bin/spark-submit jobs/train.py --config configs/train.yaml --dry-run", False),
    (".venv/bin/spark-submit jobs/train.py --config configs/train.yaml --dry-run", True),
    ("spark-submit jobs/train.py --config configs/train.yaml --dry-run", True),
    (".venv/bin/python -m jobs.train --config configs/train.yaml --dry-run", False),
    ("python -m jobs.train --config configs/train.yaml --dry-run", True),
], ids=["venv spark-submit", "venv spark-submit, activated", "spark-submit, activated", "venv python",
        "python, activated"])
def test_the_virtualenv_launchers_with_and_without_activation(command, activated, tmp_path):
    """The same job from a new shell, with the virtualenv activated or not: the configuration resolves
    (its input is checked: a missing manifest is one line naming ``make run``)."""
    for name in (".venv", "jobs", "configs"):   # a checkout without runs/
        (tmp_path / name).symlink_to(REPO / name)
    r = sh(command, cwd=tmp_path, env=activated_env() if activated else clean_env(), timeout=300, merged=True)
    last = lines(r.stdout)[-1]
    assert r.returncode == 2 and last.startswith("error: shard manifest not found") and "`make run`" in last, \
        r.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_make_target_logs_at_warn(tmp_path):
    """``make run-images`` with a small run in ``ARGS``: the Makefile's spark-submit, no Spark INFO
    line, the job's SUMMARY last. (``ARGS=--verbose`` through the Makefile: the slot-error run below.)"""
    args = (f"--set ingest.source=sklearn_digits --set ingest.limit=150 --set workers=1 --set train.launcher=local "
            f"--set train.epochs=1 --set train.progress=false --set output_root={tmp_path / 'run'}")
    r = sh(["make", "run-images", f"ARGS={args}"], cwd=REPO, timeout=600, merged=True)
    assert r.returncode == 0, r.stdout[-3000:]
    info = spark_info_lines(r.stdout)
    assert info == [], info[:3]
    assert lines(r.stdout)[-1].startswith("SUMMARY run_images: "), lines(r.stdout)[-3:]


# ------------------------------------------------------------------ executors without the dependencies
def _without_pyarrow(python: Optional[str]) -> Optional[str]:
    """``python``'s own path (``sys.executable``) when it is of this minor version and lacks pyarrow."""
    import sys

    if not python or not Path(python).exists():
        return None
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    r = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2], sys.executable); "
                        "import pyarrow"], capture_output=True, text=True, env=clean_env())
    version, _, exe = r.stdout.strip().partition(" ")
    return exe if r.returncode != 0 and version == mine and "pyarrow" in r.stderr else None


def _python3_on_clean_path() -> Optional[str]:
    return _without_pyarrow(shutil.which("python3", path=clean_env()["PATH"]))


def _bare_python() -> str:
    """A Python of this minor version without the project's dependencies on any machine: a virtualenv
    of the base interpreter without pip or packages (made once per session)."""
    import tempfile
    import venv

    root = Path(tempfile.gettempdir()) / f"hep-bare-python-{os.getuid()}"
    exe = root / "bin" / "python3"
    if not exe.exists():
        venv.EnvBuilder(with_pip=False, clear=True).create(root)
    found = _without_pyarrow(str(exe))
    assert found, f"{exe} imports pyarrow or is another Python version"
    return found


def _system_python() -> str:
    for c in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3", path=clean_env()["PATH"])):
        if _without_pyarrow(c):
            return _without_pyarrow(c)
    return _bare_python()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_job_whose_executors_lack_the_dependencies_stops_with_one_line(tmp_path):
    py = _system_python()
    out = tmp_path / "digits"
    r = sh(_job("python -m", "ingest_images", [*DIGITS, "--output", str(out)]), cwd=tmp_path,
           env=clean_env(PYSPARK_PYTHON=py), timeout=300, merged=True)
    text = r.stdout
    assert r.returncode == 2, text[-3000:]
    last = lines(text)[-1]
    assert last.startswith("error:") and "PYSPARK_PYTHON" in last and py in last and "pyarrow" in last, last
    assert "ModuleNotFoundError" not in text and "Traceback" not in text, text[-3000:]
    assert not out.exists()


_DATASOURCE_SCRIPT = '''
import sys
from pyspark.sql import SparkSession
from pipeline.ingest.datasource import register

spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
register(spark)
df = spark.read.format("root").option("tree", "Delphes").option("filter_name", "Muon.PT").load(sys.argv[1])
print("ROWS", df.count())
'''


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("case", ["PYSPARK_PYTHON=system python3", "no PYSPARK_PYTHON", "PYSPARK_PYTHON=venv"])
def test_the_datasource_example_in_a_plain_script(case, tmp_path, delphes_root):
    """pipeline/ingest/datasource.py's example in a script run with the virtualenv's Python, not
    activated: executors without pyarrow are named in one line at ``register``; with the
    virtualenv's Python on the executors the held-out file is read (25 events)."""
    script = tmp_path / "script.py"
    script.write_text(_DATASOURCE_SCRIPT)
    if case == "PYSPARK_PYTHON=system python3":
        py = _system_python()
        env = clean_env(PYSPARK_PYTHON=py or "")
    elif case == "no PYSPARK_PYTHON":   # Spark runs `python3` from PATH
        py = _python3_on_clean_path()
        env = clean_env()
        if py is None:                  # no such python3 on PATH here: put one first on PATH
            py = _bare_python()
            env = clean_env(PATH=str(Path(py).parent) + os.pathsep + env["PATH"])
    else:
        py, env = None, clean_env(PYSPARK_PYTHON=str(VENV_BIN / "python"))
    r = sh([str(VENV_BIN / "python"), str(script), str(delphes_root)], cwd=tmp_path, env=env, timeout=300)
    text = r.stdout + r.stderr
    if case == "PYSPARK_PYTHON=venv":
        assert r.returncode == 0 and "ROWS 25" in r.stdout.splitlines(), text[-3000:]
        return
    assert r.returncode != 0 and "ROWS" not in r.stdout
    last = lines(r.stderr)[-1]
    assert "PYSPARK_PYTHON" in last and py in last and "pyarrow" in last, last
    assert sum("PYSPARK_PYTHON" in ln and "lacks" in ln for ln in text.splitlines()) == 1, "reported more than once"
    assert "ModuleNotFoundError" not in text, text[-3000:]


def test_the_check_runs_once_per_session_and_passes_with_the_project_python(spark):
    from pipeline.spark import check_executor_python

    assert check_executor_python(spark) is None
    assert check_executor_python(spark) is None


# ------------------------------------------------------------------ the flag of the entry point
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("how,flag,not_flag", [
    ("python -m", "--spark.master local[3]", "--master local[3]"),
    ("spark-submit", "--master local[3]", "--spark.master"),
    ("make", "--master local[3]", "--spark.master"),
])
def test_the_slot_error_names_the_flag_of_the_entry_point_and_verbose_brings_info_back(how, flag, not_flag,
                                                                                       tmp_path):
    """The image slice with 3 workers on a 2-slot session fails fast, and the line suggests the
    option that this entry point accepts (``make run-images`` runs spark-submit on ``local[*]``:
    one worker more than the cores). The run is ``--verbose``: Spark's INFO lines come back from each entry point,
    through the Makefile's log4j configuration too; the job's error line stays the last of ours."""
    workers = 3 if how != "make" else (os.cpu_count() or 2) + 1     # make: local[*], one slot per core
    flag, not_flag = flag.replace("[3]", f"[{workers}]"), not_flag.replace("[3]", f"[{workers}]")
    args = ["--set", f"workers={workers}", "--set", "ingest.source=sklearn_digits", "--set", "ingest.limit=150",
            "--set", "train.epochs=1", "--set", f"output_root={tmp_path / 'run'}", "--verbose"]
    if how == "make":
        cmd, cwd = ["make", "run-images", "ARGS=" + " ".join(args)], REPO
    else:
        cmd, cwd = _job(how, "run_images", args, master="local[2]"), tmp_path
    r = sh(cmd, cwd=cwd, timeout=600, merged=True)
    assert r.returncode == 2, r.stdout[-3000:]
    info = spark_info_lines(r.stdout)
    assert len(info) >= 5 and any("SparkContext" in ln for ln in info), r.stdout[-3000:]
    ours = [ln for ln in lines(r.stdout) if ln not in info and not ln.startswith("make")]  # Spark's shutdown lines may follow
    last = ours[-1]
    assert last.startswith("error:") and f"workers={workers}" in last and flag in last and not_flag not in last, last


def test_the_slot_error_from_python_names_the_config_key(spark):
    from pipeline.errors import ConfigError
    from pipeline.spark import check_task_slots

    with pytest.raises(ConfigError) as e:
        check_task_slots(spark, 3)
    assert "SparkConfig(master='local[3]')" in str(e.value) and "--master" not in str(e.value)


@pytest.mark.parametrize("launcher,fails", [("horovod", True), ("torch", True), ("local", False)])
def test_a_workflow_checks_the_slots_before_its_first_stage(launcher, fails, spark, tmp_path):
    """workers=3 on the 2-slot session: a Spark launcher fails before the ingestion writes
    anything; the local launcher needs no task slots and passes the check."""
    from pipeline.errors import ConfigError
    from pipeline.train.launch import check_launch_slots
    from pipeline.workflows import ImagesRunConfig, images_stage_configs, run_images

    cfg = ImagesRunConfig(workers=3, output_root=str(tmp_path / "run"),
                          ingest={"source": "sklearn_digits", "limit": 150}, train={"launcher": launcher})
    if not fails:
        stages = images_stage_configs(cfg, {k: tmp_path / k for k in ("dataset", "shards", "train")})
        assert check_launch_slots(stages["train"], spark) is None
        return
    with pytest.raises(ConfigError, match="workers=3 needs 3 Spark task slots"):
        run_images(cfg, spark)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env,expect", [
    ({"AIRFLOW_CTX_DAG_ID": "images_pipeline"}, "the DAG param spark_master=local[3]"),
    ({"PYSPARK_GATEWAY_PORT": "1"}, "--master local[3]"),
    ({}, "SparkConfig(master='local[3]')"),
])
def test_the_hint_follows_the_entry_point(env, expect, monkeypatch):
    from pipeline.config import option_hint

    for k in ("AIRFLOW_CTX_DAG_ID", "PYSPARK_GATEWAY_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert option_hint("spark.master", "local[3]") == expect
