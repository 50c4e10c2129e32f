#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 with gloo and PyTorch support into the given Python.
#
# Horovod's CMake forces -std=c++14, but torch >= 2.1 headers need C++17, so we compile
# through a tiny wrapper that rewrites the standard flag. The built wheel is cached in
# $PIPELINE_CACHE/wheels (default ~/.cache/hep-pipeline/wheels) so a second setup, even
# in a fresh clone, installs it in seconds instead of rebuilding.
set -euo pipefail
PY=${1:-.venv/bin/python}
CACHE=${PIPELINE_CACHE:-$HOME/.cache/hep-pipeline}
WHEELS="$CACHE/wheels"
TORCH_VER=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
TAG="horovod-0.28.1-torch${TORCH_VER}"
mkdir -p "$WHEELS/$TAG"

if "$PY" -c 'import horovod.torch' 2>/dev/null; then
  echo "[build_horovod] horovod.torch already importable"; exit 0
fi

if ! ls "$WHEELS/$TAG"/horovod-*.whl >/dev/null 2>&1; then
  echo "[build_horovod] building Horovod 0.28.1 from source (gloo, C++17 wrapper); about 2-4 minutes ..."
  WRAPDIR=$(mktemp -d)
  cat > "$WRAPDIR/cxx17" <<'WRAP'
#!/usr/bin/env bash
args=()
for a in "$@"; do
  case "$a" in
    -std=c++14|-std=c++11|-std=gnu++14|-std=gnu++11) args+=("-std=c++17") ;;
    *) args+=("$a") ;;
  esac
done
exec g++ "${args[@]}"
WRAP
  chmod +x "$WRAPDIR/cxx17"
  CXX="$WRAPDIR/cxx17" CC=gcc \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  MAKEFLAGS="-j$(nproc)" HOROVOD_BUILD_ARCH_FLAGS="" \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-binary horovod \
      -w "$WHEELS/$TAG" horovod==0.28.1
  rm -rf "$WRAPDIR"
fi
# Horovod's runtime needs (cloudpickle, psutil, pyyaml, packaging) come from requirements.txt;
# --no-deps keeps its [spark] extra (which pins pyarrow<11) out.
"$PY" -m pip install -q --no-deps "$WHEELS/$TAG"/horovod-*.whl
"$PY" -c 'import horovod.torch, horovod.spark; print("[build_horovod] horovod", horovod.__version__, "ok")'
