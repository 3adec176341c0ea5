# make run   - create .venv, install everything, run the digits pipeline on embedded local Spark
# make test  - both stacks: the full suite on the modern stack (.venv), then the `lts`-marked subset
#              (ETL, loaders incl. petastorm, one end-to-end training) on the LTS stack (.venv-lts)
#              then the Airflow lane: the nightly DAG imported by Apache Airflow's DagBag (.venv-airflow)
# make test-modern / make test-lts / make test-airflow - one lane only
# make docs  - the docs site (docs/, MkDocs) served on 127.0.0.1:8000; make docs-build writes it to site/
PYTHON ?= python3
VENV ?= .venv
LTS_VENV ?= .venv-lts
AIRFLOW_VENV ?= .venv-airflow
PY := $(VENV)/bin/python
LTS_PY := $(LTS_VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
LTS_STAMP := $(LTS_VENV)/.installed-stamp
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.installed-stamp
CONSTRAINTS ?= constraints/modern.txt
LTS_CONSTRAINTS ?= constraints/lts.txt
AIRFLOW_CONSTRAINTS ?= constraints/airflow.txt
PIP := -m pip install --disable-pip-version-check -q
DOCS_ADDR ?= 127.0.0.1:8000
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: install install-lts install-airflow run test test-modern test-lts test-airflow docs docs-build clean

install: $(STAMP)
install-lts: $(LTS_STAMP)
install-airflow: $(AIRFLOW_STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PY) $(PIP) -c $(CONSTRAINTS) torch==2.13.0
	$(PY) $(PIP) -c $(CONSTRAINTS) -e '.[test,delta,iceberg]'
	touch $(STAMP)

$(LTS_STAMP): pyproject.toml $(LTS_CONSTRAINTS)
	test -x $(LTS_PY) || $(PYTHON) -m venv $(LTS_VENV)
	$(LTS_PY) $(PIP) -c $(LTS_CONSTRAINTS) torch==2.13.0
	$(LTS_PY) $(PIP) -c $(LTS_CONSTRAINTS) -e '.[test,petastorm]'
	touch $(LTS_STAMP)

# Not shardline itself: the DAG runs spark-submit, so Airflow needs only the DAG file and the provider.
$(AIRFLOW_STAMP): $(AIRFLOW_CONSTRAINTS)
	test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/python $(PIP) -c $(AIRFLOW_CONSTRAINTS) apache-airflow apache-airflow-providers-apache-spark pytest
	touch $(AIRFLOW_STAMP)

run: install
	PYSPARK_PYTHON=$(abspath $(PY)) PYSPARK_DRIVER_PYTHON=$(abspath $(PY)) \
		$(VENV)/bin/shardline run --config conf/digits.yaml $(ARGS)

test: test-modern test-lts test-airflow

test-modern: install
	PYSPARK_PYTHON=$(abspath $(PY)) PYSPARK_DRIVER_PYTHON=$(abspath $(PY)) \
		$(VENV)/bin/pytest $(PYTEST_ARGS)

test-lts: install-lts
	PYSPARK_PYTHON=$(abspath $(LTS_PY)) PYSPARK_DRIVER_PYTHON=$(abspath $(LTS_PY)) \
		$(LTS_VENV)/bin/pytest -m lts $(PYTEST_ARGS)

# --noconftest: tests/conftest.py starts Spark, which this venv does not have.
test-airflow: install-airflow
	AIRFLOW_HOME=$(abspath .shardline/airflow) $(AIRFLOW_VENV)/bin/pytest --noconftest -p no:cacheprovider \
		$(PYTEST_ARGS) tests/airflow

# The docs site (MkDocs, docs/): pages generated from the code first, then served on 127.0.0.1 only.
docs: install
	$(PY) tools/docs_gen.py --out docs/generated
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict -a $(DOCS_ADDR)

docs-build: install
	$(PY) tools/docs_gen.py --out docs/generated
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf .shardline spark-warehouse metastore_db derby.log .pytest_cache
