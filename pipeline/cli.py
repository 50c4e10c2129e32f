"""The one command-line front end shared by every ``jobs/*.py``.

    spark-submit jobs/X.py --config configs/X.yaml [--set key=value ...] [--<key> value] [--dry-run]
    python -m jobs.X ...                                   (same options, local Spark)

Every config field is also an option (``--train.epochs 3`` == ``--set train.epochs=3``),
listed in ``--help`` with its default. Exit codes: 0 success, 2 bad input/config
(one line naming the path, column or value), 1 unexpected error (one line; set
``PIPELINE_DEBUG=1`` for the traceback), 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Type

from .config import REQUIRED, StageConfig, command_line, config_fields, input_producer, load_config
from .errors import PipelineError
from .redact import redact

log = logging.getLogger("pipeline")


def quiet_exit() -> None:
    """Nothing after a job's last line: at interpreter exit the XRootD client's handler
    (``XRootD.client.finalize``) calls ``isinstance`` on every live object, and torch's deprecated
    ``torch.distributed.reduce_op`` answers with a FutureWarning. That one warning is ignored."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"XRootD\.client\.finalize")


def setup_logging(level: int = logging.INFO) -> None:
    quiet_exit()
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("py4j", "urllib3", "matplotlib", "petastorm", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not any(isinstance(f, _Py4JRetryFilter) for f in root.filters):
        root.addFilter(_Py4JRetryFilter())
    for h in root.handlers:      # a handler's filter sees the records of every logger
        if not any(isinstance(f, _RedactFilter) for f in h.filters):
            h.addFilter(_RedactFilter())


class _RedactFilter(logging.Filter):
    """Every logged line without credentials (:func:`pipeline.redact.redact`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


class _Py4JRetryFilter(logging.Filter):
    """Drop py4j's INFO traceback of a retried command. When a pooled gateway connection was
    closed by the JVM (for example while Horovod's Spark job runs), py4j resends the command on a
    new connection and logs the first failure with a full ``Py4JNetworkError`` traceback through
    the *root* logger at INFO level (``logging.info`` in ``java_gateway.py``), which reads like a
    crash. A command that fails for good is still logged, at ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and "py4j" in record.pathname
                    and record.getMessage() == "Exception while sending command.")


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit)): \S")


def root_cause(e: BaseException) -> str:
    """The line of ``e``'s message that says what went wrong: for an error raised in a Spark
    Python worker (``PythonException``, ``Py4JJavaError``) the last ``SomeError: ...`` line of
    the worker's traceback (for example ``OSError: [Errno 28] No space left on device: ...``),
    else the first line of the message."""
    lines = [x.strip() for x in str(e).strip().splitlines()]
    if type(e).__name__ in ("PythonException", "Py4JJavaError") and len(lines) > 1:
        for line in reversed(lines):
            if _EXC_LINE.match(line) and not line.startswith(("org.apache", "java.", "py4j")):
                return line
    return (lines or [""])[0]


_MISSING = ("not found", "matches no file")
#: the documented configs: a job's built-in defaults chain like ``configs/<job>.yaml`` (tests/test_config_chain.py)
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def _producer_hint(e: PipelineError, config: Optional[str], prog: str = "") -> str:
    """For the config file's own input gone missing: the command that writes it, as the file's
    first lines say (not for an input the user pointed elsewhere). Without ``--config`` the job's
    built-in default input is that of ``configs/<prog>.yaml``, whose first lines say the same."""
    if not any(m in str(e) for m in _MISSING):
        return ""
    found = input_producer(config or (CONFIGS_DIR / f"{prog}.yaml" if prog else None))
    if not found or found[0] not in str(e):
        return ""
    return (f" (the input of {config}, {found[0]}, is written by `{found[1]}`)" if config
            else f" (the default input, {found[0]}, is written by `{found[1]}`: run it first)")


def _fmt_default(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=lambda o: o.model_dump(mode="json") if hasattr(o, "model_dump") else str(o))
    return repr(v) if isinstance(v, str) else str(v)


def build_parser(prog: str, description: str, config_cls: Type[StageConfig],
                 default_config: Optional[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=default_config, metavar="PATH",
                   help=f"YAML config file (default: {default_config})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set train.epochs=3")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config and planned inputs/outputs; do not start Spark")
    if "spark" in config_cls.model_fields:
        p.add_argument("--verbose", action="store_true",
                       help="Spark's own INFO log lines too (same as --set spark.log_level=info)")
    g = p.add_argument_group("config values (each also settable with --set KEY=VALUE)")
    for dotted, default, desc in config_fields(config_cls):
        g.add_argument(f"--{dotted}", dest=f"cfg::{dotted}", default=None, metavar="V",
                       help=(f"{desc} (required)" if default is REQUIRED
                             else f"{desc} (default: {_fmt_default(default)})").strip())
    return p


def run_job(argv: Optional[Sequence[str]], *, prog: str, description: str,
            config_cls: Type[StageConfig], run: Callable[[Any], Any],
            plan: Optional[Callable[[Any], dict]] = None,
            default_config: Optional[str] = None,
            summary: Optional[Callable[[Any, Any, float], str]] = None) -> int:
    """Parse args, build the config, then ``run(cfg)`` (or print ``plan(cfg)`` on --dry-run).
    The job ends with one line on stdout, ``SUMMARY <prog>: <summary(cfg, result, seconds)>``
    (``pipeline.summaries``), and prints nothing after it."""
    with command_line():
        return _run_job(argv, prog, description, config_cls, run, plan, default_config, summary)


def _run_job(argv, prog, description, config_cls, run, plan, default_config, summary) -> int:
    setup_logging()
    parser = build_parser(prog, description, config_cls, default_config)
    args = parser.parse_args(list(argv) if argv is not None else None)
    overrides = list(args.overrides)
    if getattr(args, "verbose", False):
        overrides.append("spark.log_level=info")
    for k, v in vars(args).items():
        if k.startswith("cfg::") and v is not None:
            overrides.append(f"{k[5:]}={v}")
    t0 = time.time()
    try:
        cfg = load_config(config_cls, args.config, overrides)
        if args.dry_run:
            out = {"job": prog, "config": cfg.model_dump(mode="json")}
            if plan is not None:
                out["plan"] = plan(cfg)
            print(json.dumps(redact(json.loads(json.dumps(out, default=str))), indent=2))
            return 0
        result = run(cfg)
        seconds = time.time() - t0
        text = summary(cfg, result, seconds) if summary is not None else f"done in {seconds:.0f} s"
        print(f"SUMMARY {prog}: {text}", flush=True)
        return 0
    except PipelineError as e:
        print(redact(f"error: {e}{_producer_hint(e, args.config, prog)}"), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place that turns crashes into one line
        if os.environ.get("PIPELINE_DEBUG"):
            traceback.print_exc()
        first = root_cause(e)[:500]
        print(redact(f"error: {type(e).__name__}: {first} (set PIPELINE_DEBUG=1 for the traceback)"),
              file=sys.stderr)
        return 1
