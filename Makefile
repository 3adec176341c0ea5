# make run   - create .venv, install everything, run the digits pipeline on embedded local Spark
# make test  - both stacks: the full suite on the modern stack (.venv), then the `lts`-marked subset
#              (ETL, loaders incl. petastorm, one end-to-end training) on the LTS stack (.venv-lts)
# make test-modern / make test-lts - one lane only
PYTHON ?= python3
VENV ?= .venv
LTS_VENV ?= .venv-lts
PY := $(VENV)/bin/python
LTS_PY := $(LTS_VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
LTS_STAMP := $(LTS_VENV)/.installed-stamp
CONSTRAINTS ?= constraints/modern.txt
LTS_CONSTRAINTS ?= constraints/lts.txt
PIP := -m pip install --disable-pip-version-check -q
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: install install-lts run test test-modern test-lts clean

install: $(STAMP)
install-lts: $(LTS_STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PY) $(PIP) -c $(CONSTRAINTS) torch==2.13.0
	$(PY) $(PIP) -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

$(LTS_STAMP): pyproject.toml $(LTS_CONSTRAINTS)
	test -x $(LTS_PY) || $(PYTHON) -m venv $(LTS_VENV)
	$(LTS_PY) $(PIP) -c $(LTS_CONSTRAINTS) torch==2.13.0
	$(LTS_PY) $(PIP) -c $(LTS_CONSTRAINTS) -e '.[test,petastorm]'
	touch $(LTS_STAMP)

run: install
	PYSPARK_PYTHON=$(abspath $(PY)) PYSPARK_DRIVER_PYTHON=$(abspath $(PY)) \
		$(VENV)/bin/shardline run --config conf/digits.yaml $(ARGS)

test: test-modern test-lts

test-modern: install
	PYSPARK_PYTHON=$(abspath $(PY)) PYSPARK_DRIVER_PYTHON=$(abspath $(PY)) \
		$(VENV)/bin/pytest $(PYTEST_ARGS)

test-lts: install-lts
	PYSPARK_PYTHON=$(abspath $(LTS_PY)) PYSPARK_DRIVER_PYTHON=$(abspath $(LTS_PY)) \
		$(LTS_VENV)/bin/pytest -m lts $(PYTEST_ARGS)

clean:
	rm -rf .shardline spark-warehouse metastore_db derby.log .pytest_cache
