#!/usr/bin/env bash
# Sourced by the setup scripts: create the virtualenv $VENV (with $PYTHON, default python3.11) when it
# is missing, and set PY to its Python.
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
