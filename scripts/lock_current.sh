#!/usr/bin/env bash
# Resolve requirements-current.in into the lock requirements-current.txt (every package pinned) with
# `pip install --dry-run --report` in a scratch virtualenv: nothing is installed. torch stays the
# pinned CPU build (never let pip resolve an unpinned torch: that is a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -q '^torch==' requirements-current.in || { echo "[lock] error: requirements-current.in must pin torch" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"${PYTHON:-python3.11}" -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q --disable-pip-version-check --dry-run --report "$TMP/report.json" \
  -r requirements-current.in 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$TMP/venv/bin/python" - "$TMP/report.json" <<'PY'
import json, sys
head = open("requirements-current.txt").read().split("\n")
head = [ln for ln in head[:next(i for i, ln in enumerate(head) if not ln.startswith("#"))]]
pins = sorted((i["metadata"]["name"].lower(), i["metadata"]["version"].split("+")[0])
              for i in json.load(open(sys.argv[1]))["install"])
open("requirements-current.txt", "w").write("\n".join(head + [f"{n}=={v}" for n, v in pins]) + "\n")
print(f"[lock] {len(pins)} packages pinned in requirements-current.txt")
PY
