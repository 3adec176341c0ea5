"""Nightly shardline in Airflow: etl >> train >> evaluate >> promote, one spark-submit each.

Copy (or symlink) this file into the Airflow dags folder. Needs apache-airflow-providers-apache-spark,
`spark-submit` on the Airflow worker, and an Airflow Spark connection (`spark_default`: host `yarn`, or
a `spark://` / `k8s://` master). REPO is the shardline checkout on the Airflow worker (override with
$SHARDLINE_REPO); SHARED is storage that the driver and every executor can read (NFS, a mounted bucket).

All in one task instead: application jobs/workflow.py (`shardline workflow`: ETL of only new or changed
date partitions, train, evaluate, promote; a no-op when no input changed), with the same ARGS plus
data.source=parquet and data.path=<a folder of date=<value> partitions>.

Checked by Airflow itself: tests/airflow/test_airflow_dag.py (`make test-airflow`, its own venv) imports it
with a DagBag, renders a task and builds its spark-submit command with the provider's hook. Keep the paths
as os.path.join(...) of constants and string literals too: tests/conf/test_workflows.py reads this file
with `ast` in the main lane (no Airflow there) and checks the scripts, configs and task chain.
"""
import os
from datetime import timedelta

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

try:  # Airflow 3
    from airflow.sdk import DAG
except ImportError:  # Airflow 2
    from airflow import DAG

REPO = os.environ.get("SHARDLINE_REPO", "/opt/shardline")
SHARED = "/mnt/shared/shardline"
CONFIG = os.path.join(REPO, "conf", "digits.yaml")

# The same config and overrides for every step: train reads the shards etl wrote under workdir, and
# evaluate and promote find train's model and MLflow run there.
ARGS = [
    "--config", CONFIG,
    "workdir=" + SHARED,
    "parallelism.data=2",
    "tracking.uri=http://mlflow.internal:5000",
    "tracking.registered_model=shardline-digits",
]

# Barrier training: dynamic allocation off, and num_executors * executor_cores / spark.task.cpus task
# slots >= parallelism.data (checked again by shardline before the barrier stage starts).
SPARK_CONF = {
    "spark.dynamicAllocation.enabled": "false",
    "spark.task.cpus": "1",
    "spark.pyspark.python": "/opt/venvs/shardline/bin/python",  # same torch/pyarrow on driver and executors
}

COMMON = dict(
    conn_id="spark_default",
    # Client mode: the driver (and its parameter server) runs here, where REPO/conf is readable.
    deploy_mode="client",
    num_executors=2,
    executor_cores=1,
    conf=SPARK_CONF,
)

with DAG(
    dag_id="shardline_digits_nightly",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,  # two runs would write the same shard set and checkpoints under SHARED
    default_args={"retries": 2, "retry_delay": timedelta(minutes=5)},
    tags=["shardline"],
) as dag:
    etl = SparkSubmitOperator(
        task_id="etl",
        name="shardline-etl",
        application=os.path.join(REPO, "jobs", "etl.py"),
        application_args=ARGS,
        **COMMON,
    )
    train = SparkSubmitOperator(
        task_id="train",
        name="shardline-train",
        application=os.path.join(REPO, "jobs", "train.py"),
        application_args=ARGS,
        # The driver already retries failed barrier attempts (train.max_attempts); after a driver
        # crash, rerun with "--resume" added to continue from the newest checkpoint.
        retries=0,
        **COMMON,
    )
    evaluate = SparkSubmitOperator(
        task_id="evaluate",
        name="shardline-evaluate",
        application=os.path.join(REPO, "jobs", "evaluate.py"),
        application_args=ARGS,
        **COMMON,
    )
    promote = SparkSubmitOperator(
        task_id="promote",
        name="shardline-promote",
        application=os.path.join(REPO, "jobs", "promote.py"),
        application_args=ARGS,
        **COMMON,
    )

    etl >> train >> evaluate >> promote
