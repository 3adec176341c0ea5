"""The nightly DAG as Apache Airflow itself sees it: imported by a DagBag with the Spark provider installed,
its tasks rendered and their spark-submit command lines built by the provider's own hook (no scheduler,
no metadata database, no Spark needed).

Runs in the Airflow lane (`make test-airflow`, its own venv .venv-airflow); the main lane has no Airflow
and skips this module.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

pytest.importorskip("airflow", reason="the Airflow lane (make test-airflow, .venv-airflow) runs these")

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = REPO / "conf" / "workflows" / "airflow_dag.py"
DAG_ID = "shardline_digits_nightly"
CHAIN = ["etl", "train", "evaluate", "promote"]


@pytest.fixture(scope="module")
def dag():
    # The DAG reads where shardline is checked out from $SHARDLINE_REPO: here, this checkout, so every
    # path it names must exist. The Spark connection comes from the environment, as on a real worker.
    patch = pytest.MonkeyPatch()
    patch.setenv("SHARDLINE_REPO", str(REPO))
    patch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    try:
        from airflow.dag_processing.dagbag import DagBag
    except ImportError:  # Airflow 2
        from airflow.models import DagBag
    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}, bag.import_errors
    assert list(bag.dags) == [DAG_ID]
    yield bag.dags[DAG_ID]
    patch.undo()


def test_four_spark_submit_tasks_in_order(dag):
    assert sorted(dag.task_dict) == sorted(CHAIN)
    for upstream, task in zip(CHAIN, CHAIN[1:]):
        assert dag.get_task(task).upstream_task_ids == {upstream}
    assert dag.get_task("etl").upstream_task_ids == set()
    assert {type(t).__name__ for t in dag.tasks} == {"SparkSubmitOperator"}
    assert dag.max_active_runs == 1 and not dag.catchup
    assert dag.get_task("train").retries == 0  # the driver retries barrier attempts itself


def test_every_task_points_at_files_that_exist(dag):
    for task_id in CHAIN:
        task = dag.get_task(task_id)
        assert Path(task.application) == REPO / "jobs" / f"{task_id}.py" and Path(task.application).is_file()
        args = list(task.application_args)
        config = Path(args[args.index("--config") + 1])
        assert config.is_file(), config
        assert (config.parent / "base.yaml").is_file()  # the layering base the CLI reads beside it
        overrides = args[args.index("--config") + 2:]
        assert overrides and all("=" in o and not o.startswith("-") for o in overrides), overrides
    assert len({tuple(dag.get_task(t).application_args) for t in CHAIN}) == 1  # one config for every step


def test_a_task_renders_and_the_provider_builds_its_spark_submit_command(dag):
    task = dag.get_task("train")
    import pendulum

    context = {"ds": "2026-01-01", "logical_date": pendulum.datetime(2026, 1, 1, tz="UTC"), "dag": dag,
               "task": task, "params": {}}
    task.render_template_fields(context, jinja_env=dag.get_template_env())
    hook = task._get_hook()
    command = hook._build_spark_submit_command(task.application)
    text = shlex.join(command)
    assert command[0].endswith("spark-submit")
    assert ["--master", "local[2]"] == command[command.index("--master"):command.index("--master") + 2]
    for key, value in task.conf.items():
        assert f"{key}={value}" in command, (key, text)
    assert "spark.dynamicAllocation.enabled=false" in command  # barrier mode refuses dynamic allocation
    assert ["--deploy-mode", "client"] == command[command.index("--deploy-mode"):command.index("--deploy-mode") + 2]
    assert command[command.index(task.application):] == [task.application, *task.application_args]
    assert os.path.isfile(command[command.index(task.application)])
