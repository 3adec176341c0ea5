"""`spark-submit jobs/run_pipeline.py` in its own JVM produces a complete MLflow run."""
import re

import pytest


@pytest.mark.slow
def test_spark_submit_pipeline_job(submit_pipeline):
    from mlflow import MlflowClient

    proc, uri = submit_pipeline("local[2]", "--conf", "spark.driver.bindAddress=127.0.0.1",
                                overrides=["train.epochs=5"], timeout=420)
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
