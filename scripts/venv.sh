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
# The stack installs without pip's bytecode compilation (one file after another on one core) and is
# compiled after by compile_venv on every core: 154 s -> 81 + 41 s for requirements.txt on 2 cores. The
# bytecode must be there: with PYTHONDONTWRITEBYTECODE set, every process would compile torch again.
# The package is compiled with it (pipeline/__pycache__, ignored by git): each process that imports all of
# pipeline/ would otherwise compile it again (0.9 -> 0.6 s). compileall's exit status is not checked: a
# package's files of Python 2 syntax fail, as under pip (a syntax error of ours fails the setup's imports).
compile_venv() { "$PY" -m compileall -q -j 0 "$VENV/lib" pipeline >/dev/null 2>&1 || true; }
