"""Running the pipeline job with the venv's spark-submit in its own JVM(s)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def submit_pipeline(tmp_path):
    """`submit_pipeline(master, *spark_submit_args, overrides=[...])` runs jobs/run_pipeline.py on the digits
    config with a workdir and an SQLite MLflow store under tmp_path; returns (process, tracking uri)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"

    def run(master, *spark_args, overrides=(), timeout=600):
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
               "MLFLOW_DISABLE_TELEMETRY": "true", "SPARK_LOCAL_IP": "127.0.0.1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        command = [os.path.join(os.path.dirname(sys.executable), "spark-submit"), "--master", master,
                   "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1", *spark_args,
                   os.path.join(REPO, "jobs", "run_pipeline.py"), "--config", os.path.join(REPO, "conf", "digits.yaml"),
                   f"workdir={tmp_path}", f"tracking.uri={uri}", *overrides]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout), uri

    return run
