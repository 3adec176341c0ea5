"""End to end on digits: ETL -> barrier training with the driver PS -> Spark evaluation -> MLflow."""
import json
import os

import numpy as np
import pytest

from pipeline import steps
from pipeline.config import load


@pytest.fixture(scope="module")
def outcome(spark, tmp_path_factory, conf_dir):
    work = tmp_path_factory.mktemp("e2e")
    cfg = load(f"{conf_dir}/digits.yaml", [f"workdir={work}", f"tracking.uri=sqlite:///{work}/mlflow.db",
                                           "tracking.registered_model=digits-e2e",
                                           "tracking.system_metrics_interval_s=1"])
    return cfg, steps.run_all(spark, cfg)


@pytest.mark.slow
@pytest.mark.lts  # the LTS lane's one end-to-end training
def test_digits_reaches_the_accuracy_bar(outcome):
    cfg, result = outcome
    assert result.test_metrics["accuracy"] >= 0.95
    assert result.test_metrics["macro_f1"] >= 0.94


def _raw_split_rows(spark, cfg, split: str):
    """The source rows the ETL put in `split` (same hash split), as pandas, features + label."""
    from pipeline.etl.sources import read_source
    from pipeline.etl.split import SPLIT_COLUMN, assign_split

    raw = read_source(spark, cfg.data, cfg.workdir)
    features = [c for c in raw.columns if c not in ("label", "image_id")]
    rows = assign_split(raw, ["image_id"], cfg.data.split).where(f"{SPLIT_COLUMN} = '{split}'")
    return rows.select(*features, "label").toPandas()


@pytest.mark.slow
def test_mlflow_run_holds_everything(outcome, spark):
    import mlflow
    from mlflow import MlflowClient

    cfg, result = outcome
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["parallelism.data"] == "2" and run.data.params["ps.mode"] == "sync"
    assert run.data.params["train.epochs"] == str(cfg.train.epochs)
    for key in ("train_loss", "val_loss", "val_accuracy", "samples_per_s"):
        history = client.get_metric_history(result.run_id, key)
        assert sorted(m.step for m in history) == list(range(cfg.train.epochs)), key
    assert run.data.metrics["test_accuracy"] == pytest.approx(result.test_metrics["accuracy"])
    # The driver machine, sampled while the run was open (tracking.system_metrics_interval_s).
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    assert "test_macro_f1" in run.data.metrics
    artifacts = {a.path for folder in ("data", "plots", "evaluation")
                 for a in client.list_artifacts(result.run_id, folder)}
    assert {"data/manifest.json", "plots/training_curves.png", "evaluation/confusion_matrix.png",
            "evaluation/confusion_matrix.json", "evaluation/per_class_report.json"} <= artifacts
    for png in ("plots/training_curves.png", "evaluation/confusion_matrix.png"):
        assert open(client.download_artifacts(result.run_id, png), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    report = json.loads(open(client.download_artifacts(result.run_id, "evaluation/per_class_report.json")).read())
    assert set(report) == {str(i) for i in range(10)}
    assert sum(c["support"] for c in report.values()) == steps.load_shards(cfg).split("test").rows
    (dataset_input,) = run.inputs.dataset_inputs
    manifest_data = json.loads(open(client.download_artifacts(result.run_id, "data/manifest.json")).read())
    assert manifest_data["fingerprint"].removeprefix("sha256:").startswith(dataset_input.dataset.digest)
    assert dataset_input.dataset.name == "digits-train"
    local = client.download_artifacts(result.run_id, "data/manifest.json")
    assert json.loads(open(local).read())["fingerprint"].startswith("sha256:")

    # The served model takes the RAW source rows (pixel columns) and applies the fitted standardization itself:
    # on the test split's raw rows it reproduces the Spark evaluation exactly.
    model = mlflow.pyfunc.load_model(result.model_uri)
    raw = _raw_split_rows(spark, cfg, "test")
    predicted = model.predict(raw.drop(columns=["label"]))
    assert list(predicted.columns) == ["prediction", "probability"]
    accuracy = float((predicted["prediction"].to_numpy() == raw["label"].to_numpy()).mean())
    assert accuracy == pytest.approx(result.test_metrics["accuracy"], abs=1e-6)
    versions = client.search_model_versions("name='digits-e2e'")
    assert len(versions) == 1


@pytest.mark.slow
def test_evaluate_step_reuses_the_trained_model_and_run(outcome, spark):
    cfg, result = outcome
    again = steps.evaluate(spark, cfg)
    assert again.run_id == result.run_id
    assert again.test_metrics["accuracy"] == pytest.approx(result.test_metrics["accuracy"])
