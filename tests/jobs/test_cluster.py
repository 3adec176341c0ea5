"""The pipeline job on a real multi-JVM Spark cluster: `local-cluster[2,1,1024]` runs a master, a worker
and two executor JVMs, so barrier tasks, the driver PS and evaluation cross process boundaries."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_pipeline_job_on_local_cluster(tmp_path):
    from mlflow import MlflowClient

    submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "MLFLOW_DISABLE_TELEMETRY": "true", "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [submit, "--master", "local-cluster[2,1,1024]", "--conf", "spark.ui.enabled=false",
         "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.executor.memory=768m",
         os.path.join(REPO, "jobs", "pipeline.py"), "--config", os.path.join(REPO, "conf", "digits.yaml"),
         f"workdir={tmp_path}", f"tracking.uri={uri}", "train.epochs=8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "master=local-cluster[2,1,1024]" in output  # spark-submit's --master won over the config
    run_id = re.search(r"mlflow run id: (\w+)", proc.stdout).group(1)
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_accuracy"] >= 0.93
    # the two ranks ran in different executor JVMs, so their Python workers fork from different daemons
    placement = re.search(r"ranks ran in 0@([^:]+):(\d+)/\d+, 1@([^:]+):(\d+)/\d+", output)
    assert placement, output[-3000:]
    assert placement.group(2) != placement.group(4)
