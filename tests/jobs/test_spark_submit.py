"""`spark-submit jobs/pipeline.py` in its own JVM produces a complete MLflow run."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_spark_submit_pipeline_job(tmp_path):
    from mlflow import MlflowClient

    submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false",
         "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
         os.path.join(REPO, "jobs", "pipeline.py"), "--config", os.path.join(REPO, "conf", "digits.yaml"),
         f"workdir={tmp_path}", f"tracking.uri={uri}", "train.epochs=5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_id = re.search(r"mlflow run id: (\w+)", proc.stdout).group(1)
    assert re.search(r"test metrics: .*\"accuracy\": 0\.9", proc.stdout), proc.stdout
    # spark-submit's PythonRunner merges the driver's stderr into stdout
    assert "epoch 5/5" in proc.stdout + proc.stderr  # the per-epoch progress line
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_accuracy"] > 0.9
    assert len(MlflowClient(uri).get_metric_history(run_id, "train_loss")) == 5
    assert run.outputs.model_outputs  # the logged model
