"""train.profile end to end: a real local Spark run of digits, the breakdown in every epoch's MLflow metrics."""
import pytest

from pipeline import steps
from pipeline.config import load
from pipeline.worker.timing import PHASES


@pytest.mark.slow
def test_digits_with_profile_logs_the_breakdown_per_epoch(spark, tmp_path, conf_dir):
    from mlflow import MlflowClient

    epochs = 2
    cfg = load(f"{conf_dir}/digits.yaml", [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                                           f"train.epochs={epochs}", "train.profile=true",
                                           "tracking.log_model=false"])
    steps.etl(spark, cfg)
    outcome = steps.train(spark, cfg)
    client = MlflowClient(outcome.tracking_uri)
    by_epoch: dict[int, dict[str, float]] = {}
    for key in [f"time/{p}_ms" for p in PHASES] + ["time/step_ms", "time/other_ms"]:
        history = client.get_metric_history(outcome.run_id, key)
        assert sorted(m.step for m in history) == list(range(epochs)), key
        for m in history:
            by_epoch.setdefault(m.step, {})[key] = m.value
    for epoch, row in by_epoch.items():
        parts = sum(row[f"time/{p}_ms"] for p in PHASES)
        assert 0.9 * row["time/step_ms"] <= parts <= row["time/step_ms"] * (1 + 1e-6), (epoch, row)
    for key in ("ps/reduce_ms", "ps/optimizer_ms", "ps/sync_wait_ms", "ps/updates"):  # the server's, per epoch
        history = client.get_metric_history(outcome.run_id, key)
        assert sorted(m.step for m in history) == list(range(epochs)), key
    assert all(m.value > 0 for m in client.get_metric_history(outcome.run_id, "ps/optimizer_ms"))
    metrics = client.get_run(outcome.run_id).data.metrics
    assert metrics["ps/timed_updates"] > 0 and metrics["ps/time_optimizer_s"] > 0
