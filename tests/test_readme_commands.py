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

Each fixed cost is paid once per entry point (the shell start, the interpreter, the JVM of
``spark-submit``), not once per page that mentions it:

* of the commands run as written, one per job and config file runs (``.venv/bin/spark-submit
  jobs/train.py --config configs/train.yaml``); another command of the same job and config
  (other ``--set`` values, another page, another launcher) runs its ``--dry-run``;
* a ``--dry-run`` runs in a new shell once per entry point (the launcher as written and the job:
  ``.venv/bin/python -m jobs.experiment``), unless a command of that entry point already runs there;
  the other commands of the entry point run their ``--dry-run`` in this process, through the job's
  own ``main`` with the same arguments (the same parsing, config, overrides and plan).

``test_every_command_is_covered_by_a_run_of_its_entry_point`` checks that every command that does not
run in a new shell has one of its entry point that does.

An unlisted command that fails or runs longer fails its test, which says to fix the page or list it.
No command may change the checkout.
"""
from __future__ import annotations

import importlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from doc_commands import DocCommand, all_commands, is_template
from shell_fixtures import REPO, clean_env, lines, sh, spark_info_lines


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
    re.compile(r"^bash scripts/gpu_inprocess_check\.sh"): "needs a CUDA device (without one it prints one line and "
                                                        "exits 1: tests/test_inprocess_launcher.py)",
    re.compile(r"^\.venv-current/"): "the current environment's virtualenv, which make test-current builds",
    re.compile(r"^pip install --dry-run --report"): "what scripts/lock_current.sh runs in a scratch virtualenv (a "
                                                    "phrase in the text)",
    re.compile(r"spark://master-host|--master yarn|k8s://"): "an example cluster (tests/test_cluster_isolated.py "
                                                             "runs the same jobs on a loopback standalone cluster)",
    re.compile(r"/tmp/hep-env"): "builds and packs a second full environment to ship to a cluster (pip, the Horovod "
                                 "build, venv-pack: many minutes)",
    "python -m venv": "a phrase in the text",
    "python -m": "a phrase in the text (docs/DEVELOPING.md's table of cheaper tests)",
    "spark-submit jobs/ingest_images.py": "a phrase in the text (docs/DEVELOPING.md's table of cheaper tests)",
    "pip install -e": "a phrase in the text",
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
    re.compile(r"^make (test|test-fast)( TEST_WORKERS=\d+)?$"): "the test suite itself (minutes to tens of minutes)",
    "make bench": "every benchmark (about an hour)",
    "make gpu-check": "needs a CUDA device (exits 1 without one)",
    "make test-current": "builds the current environment (.venv-current) and runs its tests: tens of minutes",
    "make contracts": "rewrites schemas/contracts/ in the checkout (tests/test_contracts.py compares them)",
    "make setup": "the setup itself (the tests run after it)",
    "make services": "installs the test services (apt-get as root)",
    re.compile(r"^\.venv/bin/python -m pytest "): "a part of the test suite (minutes)",
    re.compile(r"^\.venv/bin/python bench/"): "a benchmark (minutes to hours on 2 idle cores)",
    ".venv/bin/python -m pipeline.contracts": "rewrites schemas/contracts/ in the checkout",
    re.compile(r"--input runs/hep/(table|day/)"): "the daily recipe's later steps read the table its first step writes "
                                                 "(tests/test_dags_daily.py runs the three in order, twice)",
    re.compile(r"^(\.venv/bin/)?python -m jobs\.results_tables$"): "rewrites docs/results.md in the checkout when records "
                                                                 "were added (tests/test_studies.py checks the page)",
    re.compile(r"^\.venv/bin/python -m jobs\.experiment --config configs/"): "a study: several trainings (minutes to hours)",
    re.compile(r"^\.venv/bin/python -m jobs\.tune --config configs/"): "a search: several trainings (minutes)",
    re.compile(r"^\.venv/bin/python -m jobs\.whatif "): "a what-if: a training per algorithm and worker count (a minute "
                                                      "or more; tests/test_whatif.py runs the command on small shards)",
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
    configs, smaller (300 events per class, scikit-learn's 1,797 digits, one epoch with the workers as
    ranks of this process)."""
    from pipeline.config import load_config
    from pipeline.workflows import HepRunConfig, ImagesRunConfig, run_hep, run_images

    runs = tmp_path_factory.mktemp("upstream") / "runs"
    hep = load_config(HepRunConfig, REPO / "configs" / "run_hep.yaml", [
        f"output_root={runs / 'hep'}", "events_per_class=300", "real_samples=false", "simulate.progress=false",
        "train.launcher=inprocess", "train.epochs=1", "train.progress=false"])
    run_hep(hep, spark)
    images = load_config(ImagesRunConfig, REPO / "configs" / "run_images.yaml", [
        f"output_root={runs / 'images'}", "ingest.source=sklearn_digits", "train.launcher=inprocess", "train.epochs=1",
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


@pytest.fixture(scope="module")
def shared_checkout(upstream, tmp_path_factory) -> Path:
    """One scratch checkout for the dry runs in the test process (they write nothing)."""
    return _checkout(tmp_path_factory.mktemp("dry"), upstream)


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
_SHELLS_RUN: set[tuple[str, str]] = set()              # entry points of make recipes run in a new shell


def _run_dry(command: str, work: Path, here) -> None:
    """The dry forms of ``command`` in a new shell; the job lines of a make recipe through ``here``
    (the job's ``main`` in this process) when a command of their entry point runs in a shell."""
    for form in _dry_forms(command):
        if form.endswith(" --help") and form in _HELP:
            r = _HELP[form]
        else:
            r = _HELP[form] = sh(form, cwd=work, timeout=RUN_LIMIT_S, merged=True)
        assert r.returncode == 0, f"`{form}` exits {r.returncode}:\n" + "\n".join(lines(r.stdout)[-15:])
        if form.startswith("make -n "):
            jobs = [ln for ln in r.stdout.splitlines() if _JOB.search(ln) and not ln.startswith(("make", "#"))]
            for job_line in jobs:
                key = entry_point(job_line)
                if key in SHELL_ENTRIES or key in _SHELLS_RUN:
                    here(job_line)
                    continue
                _SHELLS_RUN.add(key)
                d = sh(f"{job_line} --dry-run", cwd=work, timeout=RUN_LIMIT_S, merged=True)
                assert d.returncode == 0, f"`{job_line} --dry-run` (from {command}) exits {d.returncode}:\n" + \
                    "\n".join(lines(d.stdout)[-15:])
        if form.endswith(" --help") and "bench/" in form:
            used = set(re.findall(r"(?<!\S)(--[\w-]+)", command))
            missing = sorted(o for o in used if o not in r.stdout)
            assert not missing, f"{command}: {missing} not among the options of `{form}`"


def _dry_here(command: str, work: Path, monkeypatch, capsys) -> None:
    """``command --dry-run`` in this process: the job's ``main`` with the command's own arguments
    (split as the shell splits them), from the scratch checkout. The same parsing, config file,
    overrides and plan as in a new shell; the shell start itself is tested once per entry point."""
    call = job_call(command)
    assert call, f"{command}: not a job command"
    _, job, args = call
    monkeypatch.chdir(work)
    main = importlib.import_module(f"jobs.{job}").main
    capsys.readouterr()
    try:
        rc = main([*args, "--dry-run"])
    except SystemExit as e:     # argparse: an unknown option or a bad value
        rc = e.code
    out = capsys.readouterr()
    assert rc == 0, f"`{command} --dry-run` (in the test process) exits {rc}:\n" + \
        "\n".join(lines(out.out + out.err)[-15:])
    assert f'"job": "{job}"' in out.out, out.out[-2000:]


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


# ------------------------------------------------------------------------------ entry points
def job_call(command: str) -> Optional[tuple[str, str, list[str]]]:
    """(launcher as written, job, the job's own arguments) of ``LAUNCHER [options] jobs/X.py ARGS``
    or ``PYTHON -m jobs.X ARGS``; None for any other command."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    for i, w in enumerate(words):
        m = re.fullmatch(r"jobs/(\w+)\.py", w)
        if m and words[0].endswith("spark-submit"):
            return words[0], m.group(1), words[i + 1:]
        m = re.fullmatch(r"jobs\.(\w+)", w)
        if m and i > 0 and words[i - 1] == "-m":
            return words[0], m.group(1), words[i + 1:]
    return None


def entry_point(command: str) -> Optional[tuple[str, str]]:
    """(launcher as written, job): what a new shell starts for a job command."""
    call = job_call(command)
    return call[:2] if call else None


def _config_file(args: list[str]) -> Optional[str]:
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


AS_WRITTEN, DRY_SHELL, DRY_HERE = "as written", "dry in a new shell", "dry in the test process"


def _modes() -> tuple[dict[str, str], set]:
    """command -> how it runs, and the entry points started in a new shell. Of the commands run as
    written, the first of each job and config file (a launcher's own start is the shell dry run of
    its entry point, and the job's work does not depend on the launcher); then the dry forms: in a new shell for
    the first command of an entry point no command runs in a shell for, in this process for the rest.
    Commands that are not jobs (make, bench, pytest, scripts) keep their own forms in a new shell."""
    modes: dict[str, str] = {}
    ran: set = set()
    shells: set = set()
    for c in RUNNABLE:
        if classify(c.command)[0] != "run":
            continue
        call = job_call(c.command)
        if call and "--dry-run" not in call[2] and "--help" not in call[2]:
            key = (call[1], _config_file(call[2]))     # a job and its config file, whichever launcher
            if key in ran:
                modes[c.command] = DRY_HERE
                continue
            ran.add(key)
        if call:
            shells.add(call[:2])
        modes[c.command] = AS_WRITTEN
    for c in RUNNABLE:
        if c.command in modes:
            continue
        key = entry_point(c.command)
        if key is None or key not in shells:
            modes[c.command] = DRY_SHELL
            if key:
                shells.add(key)
        else:
            modes[c.command] = DRY_HERE
    return modes, shells


MODES, SHELL_ENTRIES = _modes()


def test_every_command_that_is_not_run_is_a_template_or_listed_with_its_reason():
    """The commands left out of the runs below: each a template or in NOT_RUN with a reason."""
    left = [c for c in COMMANDS if c not in RUNNABLE]
    assert left and len(RUNNABLE) > len(left)
    for c in left:
        kind, why = classify(c.command)
        assert kind in ("template", "not run") and why.strip(), (c.id, kind, why)


def test_every_command_is_covered_by_a_run_of_its_entry_point():
    """A command whose dry form runs in the test process has a command of the same entry point
    that runs in a new shell; one run as written is dry only where another command of the same
    job and config file runs as written."""
    assert set(MODES) == {c.command for c in RUNNABLE}
    in_shell = {entry_point(c) for c, m in MODES.items() if m != DRY_HERE}
    as_written = {(job_call(c)[1], _config_file(job_call(c)[2])) for c, m in MODES.items()
                  if m == AS_WRITTEN and job_call(c)}
    for command, mode in MODES.items():
        if mode != DRY_HERE:
            continue
        call = job_call(command)
        assert call and call[:2] in in_shell, command
        if classify(command)[0] == "run":
            assert (call[1], _config_file(call[2])) in as_written, command
    # what the grouping saves must not be everything: each kind of run is still there
    assert {AS_WRITTEN, DRY_SHELL, DRY_HERE} <= set(MODES.values())


# e2e and slow: the scratch checkout's runs/ comes from the HEP and image workflows (a few hundred
# events, one epoch: what the commands read), and a command run as written starts its own
# interpreter and JVM in a new shell, which is what is under test; each entry point starts once.
# The listing checks above run in the fast tier.
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("doc", RUNNABLE, ids=[c.id for c in RUNNABLE])
def test_documented_command_works_as_written(doc, request, monkeypatch, capsys):
    mode = MODES[doc.command]
    if mode == DRY_HERE:    # reads runs/, writes nothing: one checkout serves them all
        work = request.getfixturevalue("shared_checkout")
    else:
        work = _checkout(request.getfixturevalue("tmp_path"), request.getfixturevalue("upstream"))
    before = _git_status()
    if mode == DRY_HERE:
        _dry_here(doc.command, work, monkeypatch, capsys)
    elif mode == DRY_SHELL:
        _run_dry(doc.command, work, lambda line: _dry_here(line, work, monkeypatch, capsys))
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
