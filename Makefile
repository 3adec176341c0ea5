# make run   - create .venv, install everything, run the digits pipeline on embedded local Spark
# make test  - create .venv, install everything, run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
CONSTRAINTS ?= constraints/modern.txt
export PYSPARK_PYTHON := $(abspath $(PY))
export PYSPARK_DRIVER_PYTHON := $(abspath $(PY))
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: install run test clean

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PY) -m pip install --disable-pip-version-check -q -c $(CONSTRAINTS) torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check -q -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

run: install
	$(VENV)/bin/shardline run --config conf/digits.yaml $(ARGS)

test: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf .shardline spark-warehouse metastore_db derby.log .pytest_cache
