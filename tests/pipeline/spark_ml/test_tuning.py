"""ShardlineEstimator as any Spark ML stage: pyspark.ml.tuning param maps, copy and fitMultiple, the
pyspark.ml.evaluation evaluators (rawPrediction included), and one MLflow child run per fit of a search."""
from __future__ import annotations

import math

import numpy as np
import pytest


@pytest.fixture
def no_tracking(monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    while mlflow.active_run() is not None:
        mlflow.end_run()


@pytest.fixture(scope="module")
def ones_and_sevens(spark):
    """Digits 1 and 7 (a binary task: ~360 rows) as a pixel frame with a double label."""
    import pandas as pd
    from sklearn.datasets import load_digits

    data = load_digits()
    keep = np.isin(data.target, [1, 7])
    pixels = [f"pixel_{i:02d}" for i in range(data.data.shape[1])]
    frame = pd.DataFrame(data.data[keep].astype(np.float64), columns=pixels)
    frame.insert(0, "image_id", np.arange(len(frame), dtype=np.int64))
    frame["label"] = (data.target[keep] == 7).astype(np.float64)
    return spark.createDataFrame(frame).repartition(2, "image_id"), pixels


def test_fits_log_only_when_tracking_was_asked_for(no_tracking, monkeypatch, tmp_path):
    import mlflow

    from pipeline.spark_ml.tracking import tracking_overlay

    assert tracking_overlay(explicit_uri=False) == (None, {})  # a Spark ML stage has no unasked side effects
    assert tracking_overlay(explicit_uri=True) == ({}, {})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/env.db")
    assert tracking_overlay(explicit_uri=False) == ({}, {})
    uri = f"sqlite:///{tmp_path}/active.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("search")
    with mlflow.start_run() as parent:
        nested = {"tracking": {"uri": uri, "experiment": "search"}}
        assert tracking_overlay(explicit_uri=False) == (nested, {})  # mlflow nests it itself
        from pipeline.spark_ml import ShardlineEstimator

        copied = ShardlineEstimator().copy()
        inherited = copied._parent_run
        assert inherited == (uri, "search", parent.info.run_id)
    # On a tuning pool thread no run is active: the copy's inherited parent names it by tag.
    assert tracking_overlay(explicit_uri=False, inherited=inherited) == (
        nested, {"mlflow.parentRunId": parent.info.run_id})


def test_estimator_copy_takes_a_param_map_and_keeps_the_rest(tmp_path):
    from pipeline.spark_ml import ShardlineEstimator

    estimator = ShardlineEstimator(epochs=2, workdir=str(tmp_path), overrides=["train.lr=0.05"])
    copied = estimator.copy({estimator.epochs: 5, estimator.learningRate: 0.1})
    assert copied.getOrDefault(copied.epochs) == 5 and estimator.getOrDefault(estimator.epochs) == 2
    cfg = copied.pipeline_config()
    assert cfg.train.epochs == 5 and cfg.train.lr == 0.05  # overrides apply last, over the typed Params
    assert copied.uid == estimator.uid and copied.getRawPredictionCol() == "rawPrediction"


@pytest.mark.slow
def test_train_validation_split_searches_evaluates_and_logs_a_child_run_per_fit(
        spark, ones_and_sevens, tmp_path, no_tracking):
    import mlflow
    from mlflow import MlflowClient
    from pyspark.ml import Pipeline
    from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    from pipeline.spark_ml import ShardlineEstimator, ShardlineModel

    df, pixels = ones_and_sevens
    train_df, held_out = df.where(df.image_id % 4 != 0), df.where(df.image_id % 4 == 0)
    estimator = ShardlineEstimator(workdir=str(tmp_path / "work"), name="ones_sevens", parallelism=2,
                                   hidden=[16], batchSize=32, overrides=["ps.timeout_s=60"])
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=pixels, outputCol="features"), estimator])
    grid = ParamGridBuilder().addGrid(estimator.epochs, [1, 3]).build()
    search = TrainValidationSplit(estimator=pipeline, estimatorParamMaps=grid, trainRatio=0.75, seed=7,
                                  evaluator=BinaryClassificationEvaluator(rawPredictionCol="rawPrediction"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("tuning")
    with mlflow.start_run(run_name="search") as parent:
        tuned = search.fit(train_df)  # fitMultiple over the grid, then the best map refitted on all rows

    auc = tuned.validationMetrics
    assert len(auc) == 2 and all(0.5 < value <= 1.0 for value in auc), auc
    best = tuned.bestModel.stages[-1]
    assert isinstance(best, ShardlineModel)
    assert best.getOrDefault(best.epochs) == [1, 3][int(np.argmax(auc))]  # the param map went through copy

    scored = tuned.transform(held_out)
    raw = scored.select("rawPrediction", "probability").collect()
    assert all(len(r["rawPrediction"]) == 2 for r in raw)
    np.testing.assert_allclose([np.exp(r["rawPrediction"].toArray()) for r in raw],
                               [r["probability"].toArray() for r in raw], rtol=1e-5, atol=1e-7)
    assert BinaryClassificationEvaluator(metricName="areaUnderROC").evaluate(scored) > 0.95
    assert BinaryClassificationEvaluator(metricName="areaUnderPR").evaluate(scored) > 0.95
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored) > 0.85
    assert math.isfinite(MulticlassClassificationEvaluator(metricName="logLoss").evaluate(scored))

    client = MlflowClient(uri)
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 3  # one per param map, and the refit of the best
    assert sorted(run.data.params["train.epochs"] for run in children) == sorted(["1", "3", str(
        best.getOrDefault(best.epochs))])
    for run in children:
        assert run.info.status == "FINISHED" and run.data.tags["shardline.entry"] == "spark_ml"
        assert 0.0 <= run.data.metrics["test_accuracy"] <= 1.0  # each fit's own test split
        assert mlflow.search_logged_models(experiment_ids=[parent.info.experiment_id],
                                           filter_string=f"source_run_id = '{run.info.run_id}'",
                                           output_format="list")
    assert max(run.data.metrics["test_accuracy"] for run in children) > 0.85  # 1 epoch of ~10 steps may not


@pytest.mark.slow
def test_a_regression_model_answers_the_regression_evaluator(spark, tmp_path, no_tracking):
    import pandas as pd
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.feature import VectorAssembler

    from pipeline.spark_ml import ShardlineEstimator

    rng = np.random.default_rng(5)
    x = rng.normal(size=(1200, 4))
    frame = pd.DataFrame(x, columns=["a", "b", "c", "d"])
    frame["y"] = 30.0 + 4.0 * x[:, 0] - 3.0 * x[:, 1] + 2.0 * x[:, 2] * x[:, 3] + rng.normal(scale=0.5, size=1200)
    frame.insert(0, "row", np.arange(1200, dtype=np.int64))
    df = VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features").transform(
        spark.createDataFrame(frame).repartition(2, "row"))
    estimator = ShardlineEstimator(labelCol="y", workdir=str(tmp_path / "work"), name="linear", parallelism=2,
                                   hidden=[32], epochs=8, batchSize=32,
                                   overrides=["data.task=regression", "train.lr=0.01", "ps.timeout_s=60"])
    model = estimator.fit(df.where("row % 5 != 0"))
    scored = model.transform(df.where("row % 5 == 0"))
    assert "rawPrediction" not in scored.columns and "probability" not in scored.columns
    r2 = RegressionEvaluator(labelCol="y", metricName="r2").evaluate(scored)
    rmse = RegressionEvaluator(labelCol="y", metricName="rmse").evaluate(scored)
    assert r2 > 0.6 and rmse < 3.5, (r2, rmse)  # y spreads over ~5.5 std: a constant scores r2 0, rmse ~5.5
