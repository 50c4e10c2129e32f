#!/usr/bin/env bash
# The inprocess launcher on CUDA without Spark, Java or Petastorm (scripts/gpu_inprocess_check.py):
# CPU and CUDA runs of the same seed, synchronous and simulated-clock algorithms; one line with the
# verdict, exit 0 only on PASS. Python: $PYTHON, else the checkout's .venv, else python3 (it needs torch
# with CUDA, numpy, pyarrow, pydantic, pyyaml, scikit-learn, psutil, tqdm).
#   bash scripts/gpu_inprocess_check.sh [--steps 100] [--tolerance 0.03] [--workdir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
exec "$py" scripts/gpu_inprocess_check.py "$@"
