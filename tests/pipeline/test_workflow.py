"""`shardline workflow` end to end against a real `mlflow server`: incremental ETL over date partitions,
a no-op rerun, and both promotion outcomes, then the champion loaded back by alias."""
import os

import numpy as np
import pandas as pd
import pytest

from pipeline.config import build
from pipeline.workflow import run_workflow, state_dir

pytestmark = pytest.mark.slow

PARTITIONS = {"2026-11-01": (0, 700), "2026-11-02": (700, 1100), "2026-11-03": (1100, 1450),
              "2026-11-04": (1450, 1797)}


def _land(source, day):
    from sklearn.datasets import load_digits

    digits = load_digits()
    start, end = PARTITIONS[day]
    frame = pd.DataFrame(digits.data[start:end], columns=[f"p{i}" for i in range(64)])
    frame.insert(0, "id", np.arange(start, end))
    frame["label"] = digits.target[start:end]
    folder = source / f"date={day}"
    folder.mkdir(parents=True)
    frame.to_parquet(folder / "part-0.parquet", index=False)


def test_incremental_workflow_promotes_by_the_metric_rule(spark, mlflow_server, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    source = tmp_path / "source"
    for day in ("2026-11-01", "2026-11-02"):
        _land(source, day)

    def config(margin):
        return build({"name": "nightly", "workdir": str(tmp_path / "work"), "parallelism": {"data": 2},
                      "data": {"source": "parquet", "path": str(source), "id_column": "id"},
                      "model": {"hidden": [64]}, "train": {"epochs": 4, "batch_size": 16},
                      "tracking": {"uri": mlflow_server, "experiment": "nightly", "registered_model": "digits"},
                      "workflow": {"margin": margin}})

    first = run_workflow(spark, config(0.0))
    assert first.did_work and first.processed == ["2026-11-01", "2026-11-02"]
    assert first.promotion.alias == "champion" and "no champion yet" in first.promotion.reason

    client = MlflowClient(mlflow_server)
    runs_before = len(client.search_runs([client.get_experiment_by_name("nightly").experiment_id]))
    assert runs_before == 2  # the workflow's run and its nested training run
    second = run_workflow(spark, config(0.0))
    assert not second.did_work and "nothing to do" in second.reason and "unchanged" in second.reason
    assert len(client.search_runs([client.get_experiment_by_name("nightly").experiment_id])) == runs_before

    _land(source, "2026-11-03")
    third = run_workflow(spark, config(1.0))  # an impossible margin: it cannot beat the champion
    assert third.did_work and third.processed == ["2026-11-03"]  # only the new partition was ETL'd
    assert third.promotion.alias == "challenger" and "does not beat" in third.promotion.reason
    assert third.promotion.champion_metric is not None
    assert client.get_model_version_by_alias("digits", "champion").version == first.promotion.version
    assert client.get_model_version_by_alias("digits", "challenger").version == third.promotion.version
    tags = client.get_run(third.run_id).data.tags
    assert tags["shardline.promotion"] == "challenger" and "does not beat" in tags["shardline.promotion_reason"]
    parent = client.get_run(tags["mlflow.parentRunId"])  # training ran nested under the workflow's run
    assert parent.data.tags["shardline.workflow.processed"] == "2026-11-03"
    assert parent.data.tags["shardline.promotion"] == "challenger" and "test_accuracy" in parent.data.metrics
    history = client.get_metric_history(third.run_id, "rank1/wait_s")  # per-worker step metrics
    assert [m.step for m in history] == [0, 1, 2, 3]

    _land(source, "2026-11-04")
    fourth = run_workflow(spark, config(-1.0))  # any model beats the champion by more than -1
    assert fourth.processed == ["2026-11-04"] and fourth.promotion.alias == "champion"
    assert "beats" in fourth.promotion.reason
    assert client.get_model_version_by_alias("digits", "champion").version == fourth.promotion.version
    assert sorted(os.listdir(state_dir(config(0.0)))) == ["state.json"]

    # The champion loads by alias from the real server and predicts from the RAW source rows (its fitted
    # standardization inside), returning the label values and class probabilities.
    raw = pd.concat([pd.read_parquet(f) for f in sorted(source.rglob("*.parquet"))], ignore_index=True)
    mlflow.set_tracking_uri(mlflow_server)
    champion = mlflow.pyfunc.load_model("models:/digits@champion")
    predicted = champion.predict(raw[[f"p{i}" for i in range(64)]])
    assert np.stack(predicted["probability"].to_numpy()).shape == (len(raw), 10)
    assert (predicted["prediction"].to_numpy() == raw["label"].to_numpy()).mean() > 0.8
