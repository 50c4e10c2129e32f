#!/usr/bin/env bash
# Resolve requirements-current.in into the lock requirements-current.txt (every package pinned) with
# `pip install --dry-run --report` in a scratch virtualenv: nothing is installed. torch stays the
# pinned CPU build (never let pip resolve an unpinned torch: that is a multi-GB CUDA build).
#
# `bash scripts/lock_current.sh --check` resolves nothing: it checks, offline and in a second, that the
# lock pins every package once and satisfies every requirement of requirements-current.in (and of the
# files it includes with -r); exit 1 with one line per problem otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -q '^torch==' requirements-current.in || { echo "[lock] error: requirements-current.in must pin torch" >&2; exit 1; }
if [ "${1:-}" = "--check" ]; then
  exec "${PYTHON:-python3.11}" - <<'PY'
import re, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

def requirements(path):
    for ln in open(path):
        ln = ln.split(" #")[0].strip()
        if not ln or ln.startswith("#"):
            continue
        if ln.startswith("-r "):
            yield from requirements(ln[3:].strip())
        elif not ln.startswith("-"):
            yield path, Requirement(ln)

pins, problems = {}, []
for ln in open("requirements-current.txt"):
    ln = ln.strip()
    if not ln or ln.startswith("#"):
        continue
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", ln)
    if not m:
        problems.append(f"requirements-current.txt: {ln!r} is not a name==version pin")
        continue
    name = canonicalize_name(m.group(1))
    if name in pins:
        problems.append(f"requirements-current.txt: {name} is pinned twice")
    pins[name] = m.group(2)
n = 0
for src, req in requirements("requirements-current.in"):
    n += 1
    if req.marker is not None and not req.marker.evaluate():
        continue
    got = pins.get(canonicalize_name(req.name))
    if got is None:
        problems.append(f"{src}: {req} is not pinned in requirements-current.txt")
    elif not req.specifier.contains(got, prereleases=True):
        problems.append(f"{src}: {req} is not satisfied by the pin {req.name}=={got}")
for p in problems:
    print(f"[lock] error: {p}", file=sys.stderr)
if problems:
    sys.exit(1)
print(f"[lock] requirements-current.txt pins {len(pins)} packages and satisfies the {n} requirements of "
      "requirements-current.in")
PY
fi
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
