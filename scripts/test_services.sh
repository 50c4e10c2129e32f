#!/usr/bin/env bash
# Test-only services (idempotent): Debian's XRootD server and moto's S3 server. moto lives in a
# virtualenv of its own so that its dependencies (boto3, flask, ...) stay out of the pinned stack.
set -euo pipefail
if ! command -v xrootd >/dev/null 2>&1; then
  echo "[services] installing Debian's xrootd-server (XRootD tests) ..."
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xrootd-server >/dev/null
fi
S3VENV=${PIPELINE_S3_SERVER_VENV:-$HOME/.cache/hep-pipeline/s3server-venv}
if [ ! -x "$S3VENV/bin/moto_server" ]; then
  echo "[services] installing moto's S3 server into $S3VENV (object-store tests) ..."
  "${PYTHON:-python3}" -m venv "$S3VENV"
  "$S3VENV/bin/pip" install -q --disable-pip-version-check 'moto[server]==5.2.5' 2>&1 | grep -v "is ignored" || true
fi
command -v xrootd >/dev/null && [ -x "$S3VENV/bin/moto_server" ] || { echo "[services] error: test services missing" >&2; exit 1; }
