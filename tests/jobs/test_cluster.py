"""The pipeline job on a real multi-JVM Spark cluster: `local-cluster[2,1,1024]` runs a master, a worker
and two executor JVMs, so barrier tasks, the driver PS and evaluation cross process boundaries."""
import re

import pytest


@pytest.mark.slow
def test_pipeline_job_on_local_cluster(submit_pipeline):
    from mlflow import MlflowClient

    proc, uri = submit_pipeline("local-cluster[2,1,1024]", "--conf", "spark.executor.memory=768m",
                                overrides=["train.epochs=8"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "master=local-cluster[2,1,1024]" in output  # spark-submit's --master won over the config
    run_id = re.search(r"mlflow run id: (\w+)", proc.stdout).group(1)
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_accuracy"] >= 0.93
    # the two ranks ran in different executor JVMs, so their Python workers fork from different daemons
    placement = re.search(r"ranks ran in 0@([^:]+):(\d+)/\d+ \([^)]*\), 1@([^:]+):(\d+)/\d+", output)
    assert placement, output[-3000:]
    assert placement.group(2) != placement.group(4)
