import os

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture(autouse=True)
def _isolated_mlflow_env(monkeypatch):
    """Telemetry off; MLFLOW_TRACKING_URI (which mlflow.set_tracking_uri exports) restored after each test."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset-by-fixture")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    yield
    import sys

    if "mlflow" in sys.modules:
        import mlflow

        mlflow.set_tracking_uri(None)  # forget the process-wide URI start_run set (monkeypatch restores env)
