import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, mean_absolute_error, r2_score

from pipeline.config import build
from pipeline.data import read_tensors
from pipeline.etl import run_etl
from pipeline.evaluate import evaluate
from pipeline.evaluate.metrics import (classification_metrics, classification_partials, regression_metrics,
                                       regression_partials)
from pipeline.models import build_model, flat_parameters, model_spec


def test_classification_metrics_match_sklearn():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(500, 4))
    labels = rng.integers(0, 4, 500)
    halves = classification_partials(logits[:200], labels[:200], 4) + classification_partials(logits[200:],
                                                                                                labels[200:], 4)
    metrics, confusion = classification_metrics(halves, 4)
    predicted = logits.argmax(1)
    assert metrics["accuracy"] == pytest.approx(accuracy_score(labels, predicted))
    assert metrics["macro_f1"] == pytest.approx(f1_score(labels, predicted, average="macro"))
    assert (confusion == confusion_matrix(labels, predicted)).all()
    expected_loss = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(labels)).item()
    assert metrics["loss"] == pytest.approx(expected_loss)


def test_regression_metrics_match_sklearn():
    rng = np.random.default_rng(1)
    y, p = rng.normal(size=300), rng.normal(size=300)
    metrics = regression_metrics(regression_partials(p[:100], y[:100]) + regression_partials(p[100:], y[100:]))
    assert metrics["mae"] == pytest.approx(mean_absolute_error(y, p))
    assert metrics["r2"] == pytest.approx(r2_score(y, p))
    assert metrics["mse"] == pytest.approx(np.mean((y - p) ** 2))


def test_spark_evaluation_equals_local_scoring(spark, tmp_path):
    cfg = build({"name": "ev", "workdir": str(tmp_path), "parallelism": {"data": 2}, "data": {"source": "digits"}})
    manifest = run_etl(spark, cfg)
    spec = model_spec(cfg.model, num_features=manifest.num_features, num_classes=manifest.num_classes,
                      task="classification")
    torch.manual_seed(3)
    model = build_model(spec)
    result = evaluate(spark, manifest, spec, flat_parameters(model), "test")
    x, y = read_tensors(manifest.files("test"))
    with torch.no_grad():
        predicted = model(x).argmax(1).numpy()
    assert result.rows == manifest.split("test").rows == len(y)
    assert result.metrics["accuracy"] == pytest.approx(accuracy_score(y.numpy(), predicted))
    assert result.confusion.sum() == len(y)
    assert result.class_names == [str(i) for i in range(10)]
