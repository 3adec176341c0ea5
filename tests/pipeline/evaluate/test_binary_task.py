"""A binary task end to end (scikit-learn's breast-cancer data as a CSV): model.loss=bce with class
weights trains, and the evaluation reports ROC AUC and log loss, in the result and in MLflow; the
Spark-side metrics equal scikit-learn's on the same model's scores."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline import steps
from pipeline.config import load


@pytest.fixture(scope="module")
def breast_cancer_csv(tmp_path_factory):
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer(as_frame=True)
    frame = data.frame.rename(columns=lambda c: c.replace(" ", "_"))
    frame.insert(0, "id", np.arange(len(frame), dtype=np.int64))
    path = tmp_path_factory.mktemp("binary") / "breast_cancer.csv"
    frame.to_csv(path, index=False)
    return path


@pytest.mark.slow
def test_bce_with_class_weights_reports_roc_auc_and_log_loss_in_mlflow(spark, breast_cancer_csv, tmp_path):
    from mlflow.tracking import MlflowClient
    from sklearn.metrics import log_loss, roc_auc_score

    import torch

    from pipeline.data import read_tensors
    from pipeline.models import build_model, load_flat_parameters

    cfg = load(None, [f"workdir={tmp_path}", "data.source=csv", f"data.path={breast_cancer_csv}", "data.label=target",
                      "data.id_column=id", "model.loss=bce", "model.class_weights={0: 1.7, 1: 1.0}",
                      "train.epochs=5", "tracking.log_model=false", "tracking.system_metrics_interval_s=null",
                      f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"])
    outcome = steps.run_all(spark, cfg)
    metrics = outcome.test_metrics
    assert metrics["accuracy"] > 0.9 and metrics["roc_auc"] > 0.95, metrics
    logged = MlflowClient(cfg.tracking.uri).get_run(outcome.run_id).data.metrics
    assert logged["test_roc_auc"] == pytest.approx(metrics["roc_auc"])
    assert logged["test_log_loss"] == pytest.approx(metrics["log_loss"])

    manifest = steps.load_shards(cfg)
    spec, parameters, _ = steps.load_saved_model(cfg)
    model = build_model(spec)
    load_flat_parameters(model, parameters)
    model.eval()
    x, y = read_tensors(manifest.files("test"), features=manifest.feature_set)
    with torch.no_grad():
        p = model(x).softmax(1)[:, 1].numpy().astype(np.float64)
    assert metrics["log_loss"] == pytest.approx(log_loss(y.numpy(), p, labels=[0, 1]), rel=1e-4)
    assert metrics["roc_auc"] == pytest.approx(roc_auc_score(y.numpy(), p), abs=2e-3)  # histogram bins
