"""Running notebooks in their own processes (scripts, Jupyter kernels) against a throwaway workdir."""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def notebook_env(tmp_path):
    """A function of widget values returning the environment of a notebook run: the repo importable,
    executors on this interpreter, MLflow telemetry off, and the widgets (SHARDLINE_WIDGET_*) reading
    conf/digits.yaml and pointing the workdir and the MLflow store into tmp_path."""
    def make(**widgets: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SHARDLINE_WIDGET_", "PYSPARK_GATEWAY_")) and k != "MLFLOW_TRACKING_URI"}
        env.update({
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SHARDLINE_WIDGET_CONFIG": str(REPO / "conf" / "digits.yaml"),
            "SHARDLINE_WIDGET_EPOCHS": "2",
            "SHARDLINE_WIDGET_OVERRIDES": f"workdir={tmp_path / 'work'} tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        })
        env.update({f"SHARDLINE_WIDGET_{name.upper()}": value for name, value in widgets.items()})
        return env

    return make


@pytest.fixture
def printed_metrics():
    """A function returning the dict a notebook printed after `test metrics:`."""
    def parse(output: str) -> dict:
        line = next((line for line in output.splitlines() if line.startswith("test metrics:")), None)
        assert line is not None, f"no `test metrics:` line in:\n{output[-4000:]}"
        return ast.literal_eval(line.removeprefix("test metrics:").strip())

    return parse
