"""Every command README.md and docs/*.md show works as written, as a new user types it: from the
checkout's root, in a new shell, without the virtualenv activated (``PATH`` without it, no
``PYSPARK_PYTHON``, no ``VIRTUAL_ENV``: tests/shell_fixtures.py).

The commands are read from the pages (tests/doc_commands.py), so a command added to a page later is
picked up by itself. Each one runs in a scratch checkout (the repository's files linked, ``runs/``
a copy of what ``make run`` and ``make run-images`` write, made smaller here) and:

* runs as written when it takes under a minute: exit 0 within ``RUN_LIMIT_S``; a job ends with its
  ``SUMMARY <job>:`` line, and prints no Spark INFO line and no carriage return;
* runs in its dry form when ``DRY_RUN`` lists it with the reason (longer than a minute): a job
  with ``--dry-run``; a make target with ``make -n`` and the ``--dry-run`` of the job lines of its
  recipe; pytest with ``--collect-only``; a benchmark's ``--help``, which must list every option the
  page uses; ``pipeline.contracts`` and ``scripts/lock_current.sh`` with ``--check``;
* is not run when ``NOT_RUN`` lists it with the reason (an example host or bucket, a server that
  runs until stopped, a GPU, a placeholder), or when it is a template (``<name>``, ``...``,
  ``[--option X]``).

An unlisted command that fails or runs longer fails its test, which says to fix the page or list it.
No command may change the checkout.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from doc_commands import DocCommand, all_commands, is_template
from shell_fixtures import REPO, clean_env, lines, sh, spark_info_lines

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN_LIMIT_S = 300        # a command run as written: under a minute on 2 idle cores, with room for a loaded host

#: command (the exact text, or a pattern it matches) -> why it is not run at all here
NOT_RUN = {
    "spark-submit --master": "a flag named in the text",
    "spark-submit jobs/foo.py --config configs/foo.yaml --set k=v":
        "the example job of 'Writing a stage' in docs/DEVELOPING.md (jobs/foo.py is the job a developer adds)",
    re.compile(r"^export (AIRFLOW|PATH=)"): "the environment of a local Airflow, for .venv/bin/airflow standalone",
    ".venv/bin/airflow standalone": "a local Airflow: a web server that runs until stopped (tests/test_dags_e2e.py "
                                    "runs both DAGs with dag.test())",
    re.compile(r"^export AWS_"): "the credentials and endpoint of an object store (placeholders)",
    re.compile(r"example\.org"): "an example server (XRootD and HTTP inputs are tested against loopback servers in "
                     "tests/test_ingest_remote.py)",
    re.compile(r"s3://bucket/"): "an example bucket (S3 outputs are tested against a loopback S3 server in tests/test_storage_*.py)",
    re.compile(r"spark://host:7077"): "an example Spark cluster with GPUs",
    'pip install "mlflow==3.17.*"': "installs the full MLflow package into an environment of the reader's choice",
    re.compile(r"^MLFLOW_ALLOW_FILE_STORE=true \.venv/bin/mlflow ui"): "the MLflow web UI: a server that runs until stopped",
    ".venv/bin/python -m pipeline.train.selfcheck --launcher torch --gpu": "needs a CUDA device (make gpu-check)",
    re.compile(r"^\.venv-current/"): "the current environment's virtualenv, which make test-current builds",
    re.compile(r"^pip install --dry-run --report"): "what scripts/lock_current.sh runs in a scratch virtualenv (a "
                                                    "phrase in the text)",
    re.compile(r"spark://master-host|--master yarn|k8s://"): "an example cluster (tests/test_cluster_isolated.py "
                                                             "runs the same jobs on a loopback standalone cluster)",
    re.compile(r"/tmp/hep-env"): "builds and packs a second full environment to ship to a cluster (pip, the Horovod "
                                 "build, venv-pack: many minutes)",
    "python -m venv": "a phrase in the text",
    "pip install -e": "a phrase in the text",
    ".venv/bin/python -m jobs.train": "a phrase in the text (the run plan's measurement in docs/results.md)",
}

#: command (the exact text, or a pattern it matches) -> why only its dry form runs here
DRY_RUN = {
    "make run": "the HEP pipeline end to end: about 2 minutes on 2 idle cores",
    'make run ARGS="--set events_per_class=20000 --set train.epochs=10"': "60,000 generated events",
    ".venv/bin/spark-submit jobs/run_hep.py --config configs/run_hep.yaml": "the HEP pipeline: about 2 minutes",
    ".venv/bin/spark-submit jobs/run_hep.py --config configs/run_hep.yaml --set events_per_class=20000 "
    "--set train.epochs=10": "60,000 generated events",
    re.compile(r"^\.venv/bin/python -m jobs\.run_hep .*events_per_class=20000"): "60,000 generated events",
    "make run-images": "the image slice end to end: about 2 minutes",
    re.compile(r"^make (test|test-fast)$"): "the test suite itself (minutes to tens of minutes)",
    "make bench": "every benchmark (about an hour)",
    "make gpu-check": "needs a CUDA device (exits 1 without one)",
    "make test-current": "builds the current environment (.venv-current) and runs its tests: tens of minutes",
    "make contracts": "rewrites schemas/contracts/ in the checkout (tests/test_contracts.py compares them)",
    "make setup": "the setup itself (the tests run after it)",
    "make services": "installs the test services (apt-get as root)",
    re.compile(r"^\.venv/bin/python -m pytest "): "a part of the test suite (minutes)",
    re.compile(r"^\.venv/bin/python bench/"): "a benchmark (minutes to hours on 2 idle cores)",
    ".venv/bin/python -m pipeline.contracts": "rewrites schemas/contracts/ in the checkout",
    re.compile(r"^\.venv/bin/python -m jobs\.experiment --config configs/"): "a study: several trainings (minutes to hours)",
    re.compile(r"^\.venv/bin/python -m jobs\.tune --config configs/"): "a search: several trainings (minutes)",
    ".venv/bin/spark-submit jobs/simulate.py --config configs/simulate.yaml --set events=20000": "60,000 events",
    "bash scripts/lock_current.sh": "resolves the current environment against the package registry (about a "
                                    "minute) and rewrites the lock: its --check of the lock runs instead",
    ".venv/bin/spark-submit jobs/train.py --config configs/train/slowmo.yaml --launcher torch":
        "TorchDistributor, 4 epochs of LeNet-5 on 2 workers: over a minute on 2 cores",
}

_SKIP = {"runs", ".git", "spark-warehouse", "metastore_db", "derby.log", ".pytest_cache", ".hypothesis", "mlruns"}
_JOB = re.compile(r"(?:\bjobs/|-m jobs\.)(\w+)")


def _unique_commands() -> list[DocCommand]:
    seen: dict[str, DocCommand] = {}
    for c in all_commands(REPO):
        seen.setdefault(c.command, c)
    return list(seen.values())


COMMANDS = _unique_commands()


def _matches(key, command: str) -> bool:
    return bool(key.search(command)) if isinstance(key, re.Pattern) else key == command


def _listed(table: dict, command: str) -> Optional[str]:
    return next((why for key, why in table.items() if _matches(key, command)), None)


def classify(command: str) -> tuple[str, str]:
    """("template" | "not run" | "dry" | "run", why)."""
    if is_template(command):
        return "template", "a pattern to fill in"
    why = _listed(NOT_RUN, command)
    if why:
        return "not run", why
    if "--dry-run" not in command:
        why = _listed(DRY_RUN, command)
        if why:
            return "dry", why
    return "run", ""


# ------------------------------------------------------------------------------ the scratch checkout
@pytest.fixture(scope="module")
def upstream(spark, tmp_path_factory) -> Path:
    """``runs/`` as ``make run`` and ``make run-images`` leave it, from the same workflows and
    configs, smaller (300 events per class, scikit-learn's 1,797 digits, one local epoch)."""
    from pipeline.config import load_config
    from pipeline.workflows import HepRunConfig, ImagesRunConfig, run_hep, run_images

    runs = tmp_path_factory.mktemp("upstream") / "runs"
    hep = load_config(HepRunConfig, REPO / "configs" / "run_hep.yaml", [
        f"output_root={runs / 'hep'}", "events_per_class=300", "real_samples=false", "simulate.progress=false",
        "train.launcher=local", "train.epochs=1", "train.progress=false"])
    run_hep(hep, spark)
    images = load_config(ImagesRunConfig, REPO / "configs" / "run_images.yaml", [
        f"output_root={runs / 'images'}", "ingest.source=sklearn_digits", "train.launcher=local", "train.epochs=1",
        "train.progress=false"])
    run_images(images, spark)
    return runs


def _checkout(tmp_path: Path, upstream: Path) -> Path:
    work = tmp_path / "checkout"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in _SKIP:
            (work / entry.name).symlink_to(entry)
    shutil.copytree(upstream, work / "runs", symlinks=True)
    return work


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout


# ------------------------------------------------------------------------------ the dry forms
def _dry_forms(command: str) -> list[str]:
    if command.startswith("make "):
        return [command.replace("make ", "make -n ", 1)]    # the job lines of the recipe follow, see _run_dry
    if " -m pytest" in command:
        return [f"{command} --collect-only -q"]
    if re.match(r"^\.venv/bin/python bench/\w+\.py", command):
        return [" ".join(command.split()[:2]) + " --help"]
    if "-m pipeline.contracts" in command or command == "bash scripts/lock_current.sh":
        return [f"{command} --check"]
    if _JOB.search(command):
        return [f"{command} --dry-run"]
    raise AssertionError(f"{command}: no dry form known; run it as written or list it in NOT_RUN")


_HELP: dict[str, subprocess.CompletedProcess] = {}     # a benchmark's --help, once per script


def _run_dry(command: str, work: Path) -> None:
    for form in _dry_forms(command):
        if form.endswith(" --help") and form in _HELP:
            r = _HELP[form]
        else:
            r = _HELP[form] = sh(form, cwd=work, timeout=RUN_LIMIT_S, merged=True)
        assert r.returncode == 0, f"`{form}` exits {r.returncode}:\n" + "\n".join(lines(r.stdout)[-15:])
        if form.startswith("make -n "):
            jobs = [ln for ln in r.stdout.splitlines() if _JOB.search(ln) and not ln.startswith(("make", "#"))]
            for job_line in jobs:
                d = sh(f"{job_line} --dry-run", cwd=work, timeout=RUN_LIMIT_S, merged=True)
                assert d.returncode == 0, f"`{job_line} --dry-run` (from {command}) exits {d.returncode}:\n" + \
                    "\n".join(lines(d.stdout)[-15:])
        if form.endswith(" --help") and "bench/" in form:
            used = set(re.findall(r"(?<!\S)(--[\w-]+)", command))
            missing = sorted(o for o in used if o not in r.stdout)
            assert not missing, f"{command}: {missing} not among the options of `{form}`"


def _run_as_written(command: str, work: Path) -> None:
    try:
        r = sh(command, cwd=work, timeout=RUN_LIMIT_S, merged=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{command}` ran over {RUN_LIMIT_S} s: list it in DRY_RUN with the reason")
    out = lines(r.stdout)
    tool = command.split()[0]
    hint = (f"; in a new shell `{tool}` is not the virtualenv's: write `.venv/bin/{tool}`"
            if tool in ("python", "python3", "spark-submit", "pytest", "mlflow", "airflow") else "")
    assert r.returncode == 0, (f"`{command}` exits {r.returncode} in a new shell without the virtualenv activated "
                               f"(fix the page or list the command{hint}):\n" + "\n".join(out[-15:]))
    job = _JOB.search(command)
    if job and "--dry-run" not in command and "--help" not in command:
        name = job.group(1)
        assert out and out[-1].startswith(f"SUMMARY {name}: "), f"`{command}` ends with {out[-3:]}"
        assert spark_info_lines(r.stdout) == [], spark_info_lines(r.stdout)[:3]
        assert "\r" not in r.stdout, [ln for ln in r.stdout.split("\n") if "\r" in ln][:2]


RUNNABLE = [c for c in COMMANDS if classify(c.command)[0] in ("run", "dry")]


def test_every_command_that_is_not_run_is_a_template_or_listed_with_its_reason():
    """The commands left out of the runs below: each a template or in NOT_RUN with a reason."""
    left = [c for c in COMMANDS if c not in RUNNABLE]
    assert left and len(RUNNABLE) > len(left)
    for c in left:
        kind, why = classify(c.command)
        assert kind in ("template", "not run") and why.strip(), (c.id, kind, why)


@pytest.mark.parametrize("doc", RUNNABLE, ids=[c.id for c in RUNNABLE])
def test_documented_command_works_as_written(doc, upstream, tmp_path):
    kind, _ = classify(doc.command)
    work = _checkout(tmp_path, upstream)
    before = _git_status()
    if kind == "dry":
        _run_dry(doc.command, work)
    else:
        _run_as_written(doc.command, work)
    assert _git_status() == before, f"`{doc.command}` changed the checkout"


def test_the_pages_have_commands_and_every_listed_command_is_on_a_page():
    """The parser finds the pages' commands, and the lists hold no stale entries."""
    commands = [c.command for c in COMMANDS]
    assert "make run" in commands and ".venv/bin/spark-submit jobs/train.py --config configs/train.yaml" in commands
    for table in (NOT_RUN, DRY_RUN):
        for key in table:
            hit = [c for c in commands if _matches(key, c)]
            assert hit, f"{key!r} is listed but no page shows it any more: remove it"
