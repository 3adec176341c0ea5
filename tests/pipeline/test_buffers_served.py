"""Buffers are model state, end to end: a BatchNorm MLP (``model.factory``) trained with `shardline run`'s
steps carries its trained running statistics into the saved model, the MLflow model, `shardline score` and
the Spark ML model (saved and loaded), all predicting like local torch with the merged state."""
from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline import steps
from pipeline.config import load

pytestmark = pytest.mark.slow

MODELS = os.path.join(os.path.dirname(__file__), "models")


@pytest.fixture(scope="module")
def user_models(spark):
    sys.path.insert(0, MODELS)
    spark.sparkContext.addPyFile(os.path.join(MODELS, "user_models.py"))
    yield
    sys.path.remove(MODELS)


def _norm(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d))


def _local(cfg, raw):
    """The saved merged state scored in-process (eval mode: BatchNorm uses the running statistics)."""
    from pipeline.models import build_model, load_flat_state

    manifest = steps.load_shards(cfg)
    spec, state, _ = steps.load_saved_model(cfg)
    model = build_model(spec)
    load_flat_state(model, state)
    model.eval()
    x = np.column_stack([raw.column(c).to_numpy().astype(np.float64) for c in manifest.feature_columns])
    z = ((x - np.asarray(manifest.means)) / np.asarray(manifest.stds)).astype(np.float32)
    with torch.no_grad():
        out = model(torch.from_numpy(z))
    return model, torch.softmax(out, dim=1).numpy()


def test_saved_served_and_scored_models_carry_the_trained_running_statistics(spark, user_models, tmp_path,
                                                                               conf_dir):
    import mlflow

    from pipeline.score import score
    from pipeline.shards import steps_per_epoch

    cfg = load(f"{conf_dir}/digits.yaml", [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                                           "train.epochs=3", "model.factory=user_models:bn_mlp",
                                           "tracking.system_metrics_interval_s=null"])
    outcome = steps.run_all(spark, cfg)
    raw = pq.read_table(os.path.join(tmp_path, "raw", "digits")).slice(0, 200)
    model, probabilities = _local(cfg, raw)
    bn = _norm(model)
    manifest = steps.load_shards(cfg)
    assert bn.num_batches_tracked.item() == steps_per_epoch(manifest, cfg.parallelism.data, cfg.train.batch_size) * 3
    assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))

    served = mlflow.pyfunc.load_model(outcome.model_uri).predict(raw.select(manifest.feature_columns).to_pandas())
    np.testing.assert_allclose(np.array(served["probability"].tolist()), probabilities, rtol=1e-4, atol=1e-5)

    output = str(tmp_path / "scored")
    score(spark, cfg, outcome.model_uri, str(tmp_path / "raw" / "digits"), output)
    scored = pq.read_table(output).to_pandas()
    ids = raw.column("image_id").to_pylist()
    by_id = dict(zip(scored["image_id"], scored["probability"])) if "image_id" in scored else None
    got = np.array([by_id[i] for i in ids]) if by_id else np.array(scored["probability"].tolist()[:len(ids)])
    np.testing.assert_allclose(got, probabilities, rtol=1e-4, atol=1e-5)

    # A model with its running statistics reset predicts differently: the comparisons above can fail.
    bn.reset_running_stats()
    with torch.no_grad():
        x = torch.from_numpy(((np.column_stack([raw.column(c).to_numpy().astype(np.float64)
                                                for c in manifest.feature_columns]) - np.asarray(manifest.means))
                              / np.asarray(manifest.stds)).astype(np.float32))
        assert not np.allclose(torch.softmax(model(x), dim=1).numpy(), probabilities, atol=1e-3)


def test_the_spark_ml_model_saves_and_loads_its_running_statistics(spark, user_models, tmp_path):
    import pandas as pd
    from pyspark.ml.feature import VectorAssembler
    from sklearn.datasets import load_digits

    from pipeline.spark_ml import ShardlineEstimator, ShardlineModel

    data = load_digits()
    pixels = [f"pixel_{i:02d}" for i in range(data.data.shape[1])]
    frame = pd.DataFrame(data.data.astype(np.float64), columns=pixels)
    frame["label"] = data.target.astype(np.float64)
    df = VectorAssembler(inputCols=pixels, outputCol="features").transform(spark.createDataFrame(frame))
    estimator = ShardlineEstimator(featuresCol="features", labelCol="label", workdir=str(tmp_path / "work"),
                                   name="bn_ml", parallelism=2, epochs=2, batchSize=32,
                                   overrides=["model.factory=user_models:bn_mlp", "ps.timeout_s=60"])
    fitted = estimator.fit(df)
    trained = _norm(fitted.torch_model())
    assert trained.num_batches_tracked.item() > 0
    fitted.write().overwrite().save(str(tmp_path / "model"))
    # A user factory: the reader imports it only when asked to (pipeline/models/trust.py).
    loaded = _norm(ShardlineModel.read().allowFactories("user_models:bn_mlp").load(str(tmp_path / "model"))
                   .torch_model())
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(loaded, name), getattr(trained, name)), name
    assert not torch.allclose(loaded.running_var, torch.ones_like(loaded.running_var))
