"""Commands as a new user types them: in a new shell, with or without the virtualenv activated.

``clean_env()`` is the environment of a fresh shell: ``PATH`` without any virtualenv's ``bin/``,
no ``VIRTUAL_ENV``, no ``PYSPARK_PYTHON`` / ``PYSPARK_DRIVER_PYTHON`` / ``SPARK_HOME`` (the test
session sets some of these for its own Spark session). ``activated_env()`` is the same shell after
``source .venv/bin/activate``.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Optional, Sequence, Union

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv"
VENV_BIN = VENV / "bin"

_DROP = ("VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_HOME", "SPARK_CONF_DIR",
         "SPARK_ENV_LOADED", "PYTHONPATH", "PYTHONHOME", "PYSPARK_SUBMIT_ARGS", "PYSPARK_GATEWAY_PORT",
         "PYSPARK_GATEWAY_SECRET", "PIPELINE_DEBUG", "PYTHONUNBUFFERED", "AIRFLOW_HOME",
         # a new shell is not inside make: under `make test` these would make a nested make print
         # "make[1]: Entering/Leaving directory" lines a user never sees
         "MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")

#: a Spark (JVM) log line at INFO: Spark's loggers are class names (``INFO SparkContext: ...``), ours
#: are Python module names (``INFO pipeline.train.launch: ...``)
SPARK_INFO = re.compile(r"\bINFO [A-Z][\w$]*: ")


def _is_venv_bin(entry: str) -> bool:
    p = Path(entry or ".").expanduser()
    try:
        return (p.parent / "pyvenv.cfg").is_file() or p.resolve() == VENV_BIN.resolve()
    except OSError:
        return False


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith("AIRFLOW_CTX_")}
    env["PATH"] = os.pathsep.join(e for e in os.environ.get("PATH", "").split(os.pathsep) if e and not _is_venv_bin(e))
    env.update(extra)
    return env


def activated_env(**extra: str) -> dict[str, str]:
    env = clean_env()
    env["PATH"] = str(VENV_BIN) + os.pathsep + env["PATH"]
    env["VIRTUAL_ENV"] = str(VENV)
    env.update(extra)
    return env


def sh(command: Union[str, Sequence[str]], *, cwd: Union[str, Path] = REPO, env: Optional[dict] = None,
       timeout: float = 600, merged: bool = False) -> subprocess.CompletedProcess:
    """Run ``command`` (a shell line through ``bash -c``, or an argv list) with a clean environment.
    ``merged``: stderr into stdout, in the order a terminal shows them (under spark-submit the
    Python driver's stderr reaches the user through the JVM's stdout anyway). Output is decoded
    without newline translation, so carriage returns stay visible."""
    args = ["bash", "-c", command] if isinstance(command, str) else list(command)
    r = subprocess.run(args, cwd=str(cwd), env=env if env is not None else clean_env(), timeout=timeout,
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT if merged else subprocess.PIPE)
    # decoded without newline translation: a carriage return stays visible
    return subprocess.CompletedProcess(r.args, r.returncode, _text(r.stdout), _text(r.stderr))


def _text(data: Optional[bytes]) -> str:
    return data.decode("utf-8", errors="replace") if data else ""


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def spark_info_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if SPARK_INFO.search(ln)]
