#!/usr/bin/env bash
# `make test-current`: the current environment (.venv-current, scripts/setup_current.sh) runs the fast
# tier without the tests that need Petastorm or Horovod (deselected by their markers), then the HEP and
# the image pipelines end to end with spark-submit (HEP: launcher torch, TorchDistributor; images:
# launcher local), on small sizes, into a temporary directory. Prints the time each part took.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_CURRENT:-.venv-current}
ROOT=$(pwd)
export PATH="$ROOT/$VENV/bin:$PATH" PYSPARK_PYTHON="$ROOT/$VENV/bin/python" PYSPARK_DRIVER_PYTHON="$ROOT/$VENV/bin/python"
export PYTHONUNBUFFERED=1
PY="$VENV/bin/python"
SUBMIT=("$VENV/bin/spark-submit" --master "local[*]" --driver-memory 4g
        --conf "spark.driver.extraJavaOptions=-Dlog4j2.configurationFile=file:$ROOT/configs/log4j2.properties")
OUT=$(mktemp -d "${TMPDIR:-/tmp}/hep-pipeline-current-XXXXXX")
trap 'rm -rf "$OUT"' EXIT
t0=$SECONDS
echo "[test-current] fast tier, without needs_petastorm and needs_horovod"
XDIST=(-n "${TEST_WORKERS:-2}" --dist loadfile)
[ "${TEST_WORKERS:-2}" = 0 ] && XDIST=()
"$PY" -m pytest tests "${XDIST[@]}" -m "not slow and not e2e and not cluster and not needs_petastorm and not needs_horovod" --durations=15 "$@"
t1=$SECONDS
echo "[test-current] HEP pipeline end to end (launcher torch)"
"${SUBMIT[@]}" jobs/run_hep.py --config configs/run_hep.yaml --set output_root="$OUT/hep" \
  --set events_per_class=300 --set train.launcher=torch --set train.epochs=2 --set train.progress=false
t2=$SECONDS
echo "[test-current] image pipeline end to end (launcher local)"
"${SUBMIT[@]}" jobs/run_images.py --config configs/run_images.yaml --set output_root="$OUT/images" \
  --set train.launcher=local --set train.epochs=1 --set train.progress=false
t3=$SECONDS
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for name, launcher in (("hep", "torch"), ("images", "local")):
    s = json.loads((Path(sys.argv[1]) / name / "train" / "summary.json").read_text())
    assert s["launcher"] == launcher and s["steps"] > 0, s
    print(f"[test-current] {name}: {s['steps']} steps with launcher {launcher}, test accuracy {s['test_accuracy']:.3f}")
PY
echo "[test-current] passed: fast tier $((t1 - t0)) s, HEP pipeline $((t2 - t1)) s, image pipeline $((t3 - t2)) s" \
     "(load average $(cut -d' ' -f1-3 /proc/loadavg))"
