#!/usr/bin/env bash
# Make the virtualenv's Spark launchers (.venv/bin/spark-submit, pyspark, spark-class, ...) work as
# typed, in a new shell, whether or not the virtualenv is activated (idempotent; run by setup.sh).
#
# pip installs Spark's shell launchers into .venv/bin, but they find SPARK_HOME and the driver's
# Python with `python3` from PATH: without activation that is the system Python, which has no
# pyspark, and the launcher crashes before Spark starts. Here:
#   1. .venv/bin/find-spark-home: SPARK_HOME is this virtualenv's pyspark (no Python lookup);
#   2. <SPARK_HOME>/conf/spark-env.sh: the driver runs this virtualenv's Python unless
#      PYSPARK_PYTHON says otherwise (pipeline.spark gives the executors the driver's interpreter);
#   3. <SPARK_HOME>/conf/log4j2.properties -> configs/log4j2.properties: Spark logs at WARN from the
#      start of the JVM, however a job is started (spark-submit, python -m, Airflow).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(cd "${1:-${VENV:-.venv}}" && pwd)
PY="$VENV/bin/python"
SPARK_HOME_DIR=$("$PY" -c "import os, pyspark; print(os.path.dirname(os.path.realpath(pyspark.__file__)))")
MARK="# hep-pipeline: scripts/spark_launchers.sh"

# 1. find-spark-home (a new file, then renamed: never write through a hard link into another copy)
FSH="$VENV/bin/find-spark-home"
if ! grep -q "$MARK" "$FSH"; then
  tmp=$(mktemp "$FSH.XXXXXX")
  sed "s|^  export SPARK_HOME=\$(\$PYSPARK_DRIVER_PYTHON \"\$FIND_SPARK_HOME_PYTHON_SCRIPT\")\$|  export SPARK_HOME=\"$SPARK_HOME_DIR\"  $MARK|" \
    "$FSH" > "$tmp"
  if ! grep -q "$MARK" "$tmp"; then
    rm -f "$tmp"
    echo "[setup] error: $FSH has an unexpected layout; cannot point it at $SPARK_HOME_DIR" >&2
    exit 1
  fi
  chmod 755 "$tmp"
  mv -f "$tmp" "$FSH"
fi

# 2. and 3. Spark's conf directory of this virtualenv
mkdir -p "$SPARK_HOME_DIR/conf"
cat > "$SPARK_HOME_DIR/conf/spark-env.sh.new" <<EOF
$MARK
# the driver of a spark-submit job runs this virtualenv's Python unless PYSPARK_PYTHON says otherwise
PYSPARK_PYTHON="\${PYSPARK_PYTHON:-$VENV/bin/python}"
EOF
mv -f "$SPARK_HOME_DIR/conf/spark-env.sh.new" "$SPARK_HOME_DIR/conf/spark-env.sh"
ln -sfn "$(pwd)/configs/log4j2.properties" "$SPARK_HOME_DIR/conf/log4j2.properties"
echo "[setup] Spark launchers of $VENV: SPARK_HOME $SPARK_HOME_DIR, logging configs/log4j2.properties"
