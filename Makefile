# The README's two commands: `make run` and `make test`. Both set everything up on first use.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.setup-done
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYSPARK_PYTHON := $(CURDIR)/$(PY)
export PYTHONUNBUFFERED := 1
SUBMIT  := $(VENV)/bin/spark-submit --master "local[*]" --driver-memory 4g \
           --conf "spark.driver.extraJavaOptions=-Dlog4j2.configurationFile=file:$(CURDIR)/configs/log4j2.properties"

.PHONY: setup setup-current services run run-images run-hep test test-fast test-current bench gpu-check contracts clean

setup: $(STAMP)

## the XRootD and S3 servers the remote-data tests start on loopback
services:
	bash scripts/test_services.sh

$(STAMP): requirements.txt requirements-airflow.txt requirements-nodeps.txt pyproject.toml scripts/setup.sh scripts/venv.sh \
          scripts/build_horovod.sh scripts/spark_launchers.sh
	bash scripts/setup.sh
	touch $(STAMP)

## the current environment: .venv-current with requirements-current.txt (newest PySpark, pyarrow, numpy 2;
## no Petastorm, no Horovod)
VENV_CURRENT  ?= .venv-current
STAMP_CURRENT := $(VENV_CURRENT)/.setup-done
setup-current: $(STAMP_CURRENT)

$(STAMP_CURRENT): requirements-current.txt requirements-nodeps.txt pyproject.toml scripts/setup_current.sh scripts/venv.sh
	VENV_CURRENT=$(VENV_CURRENT) bash scripts/setup_current.sh
	touch $(STAMP_CURRENT)

## make run: the main job (the HEP pipeline) end to end on local Spark; ARGS: more job options,
## e.g. make run ARGS="--set train.epochs=10" (or --verbose, --dry-run)
ARGS    ?=
run: run-hep

run-hep: setup
	$(SUBMIT) jobs/run_hep.py --config configs/run_hep.yaml $(ARGS)

run-images: setup
	$(SUBMIT) jobs/run_images.py --config configs/run_images.yaml $(ARGS)

## make test: the whole suite (CI, design-card environment); make test-fast: without the slow, e2e and cluster tiers.
## The test files run on TEST_WORKERS pytest-xdist workers, each file whole on one worker (its module fixtures
## once); TEST_WORKERS=0 runs them one after another in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: setup services
	$(PY) -m pytest tests $(XDIST) --durations=15

test-fast: setup services
	$(PY) -m pytest tests $(XDIST) -m "not slow and not e2e and not cluster" --durations=15

## make test-current: the current environment's fast tier (without needs_petastorm, needs_horovod) and the
## HEP (launcher torch) and image (launcher local) pipelines end to end
test-current: setup-current services
	VENV_CURRENT=$(VENV_CURRENT) TEST_WORKERS=$(TEST_WORKERS) bash scripts/test_current.sh

bench: setup
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

## make gpu-check: backend equivalence tests + short HLF and LeNet-5 trainings on CUDA with both
## launchers, one line (device, samples/s, verdict); exits 1 at once without a CUDA device
gpu-check: setup
	$(PY) scripts/gpu_check.py

## make contracts: regenerate the published JSON Schemas (schemas/contracts/) from the pydantic models
contracts: setup
	$(PY) -m pipeline.contracts

clean:
	rm -rf runs/ spark-warehouse/ metastore_db/ derby.log
