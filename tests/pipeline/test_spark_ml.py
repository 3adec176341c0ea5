"""The Spark ML API: Pipeline([VectorAssembler, ShardlineEstimator]) fitted on digits, saved, loaded in a
fresh Python + SparkSession (a subprocess), and scoring the same rows to the same predictions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

FRESH_SESSION = textwrap.dedent("""
    import json, sys
    from pyspark.sql import SparkSession
    from pyspark.ml import PipelineModel
    from pyspark.ml.functions import vector_to_array

    model_path, rows_path, out_path = sys.argv[1:4]
    spark = (SparkSession.builder.master("local[2]").appName("shardline-spark-ml-reload")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        model = PipelineModel.load(model_path)
        stages = [type(s).__module__ + "." + type(s).__name__ for s in model.stages]
        scored = model.transform(spark.read.parquet(rows_path))
        rows = scored.select("image_id", "prediction", vector_to_array("probability").alias("p")).collect()
        result = {"stages": stages,
                  "rows": {str(r["image_id"]): [r["prediction"], list(r["p"])] for r in rows}}
        with open(out_path, "w") as f:
            json.dump(result, f)
    finally:
        spark.stop()
""")


@pytest.fixture(scope="module")
def digits(spark):
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels = [f"pixel_{i:02d}" for i in range(data.data.shape[1])]
    import pandas as pd

    frame = pd.DataFrame(data.data.astype(np.float64), columns=pixels)
    frame.insert(0, "image_id", np.arange(len(frame), dtype=np.int64))
    frame["label"] = data.target.astype(np.float64)  # Spark ML labels are doubles
    df = spark.createDataFrame(frame).repartition(2, "image_id")
    return df, pixels


@pytest.fixture(scope="module")
def fitted(spark, digits, tmp_path_factory):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    from pipeline.spark_ml import ShardlineEstimator

    df, pixels = digits
    root = tmp_path_factory.mktemp("spark-ml")
    train_df = df.where(df.image_id % 5 != 0)
    held_out = df.where(df.image_id % 5 == 0)
    estimator = ShardlineEstimator(featuresCol="features", labelCol="label", workdir=str(root / "work"),
                                   name="digits_ml", parallelism=2, hidden=[64], epochs=6, batchSize=32,
                                   overrides=["train.lr=0.05", "ps.timeout_s=60"])
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=pixels, outputCol="features"), estimator])
    model = pipeline.fit(train_df)
    return model, held_out, root


def test_fit_evaluates_and_scores_held_out_digits(fitted):
    from pipeline.spark_ml import ShardlineModel

    model, held_out, _ = fitted
    shardline = model.stages[-1]
    assert isinstance(shardline, ShardlineModel)
    assert shardline.labels == [str(i) for i in range(10)]
    assert shardline.metrics["accuracy"] >= 0.85, shardline.metrics  # the ETL's own test split
    rows = model.transform(held_out).select("label", "prediction", "probability").collect()
    assert len(rows) == 360
    accuracy = np.mean([r["label"] == r["prediction"] for r in rows])
    assert accuracy >= 0.9, accuracy
    probs = np.array([r["probability"].toArray() for r in rows])
    assert probs.shape == (360, 10)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert all(r["prediction"] == float(np.argmax(r["probability"].toArray())) for r in rows)


def test_pipeline_saved_and_loaded_in_a_fresh_session_predicts_the_same(spark, fitted):
    from pyspark.ml.functions import vector_to_array

    model, held_out, root = fitted
    model_path, rows_path, out_path = root / "pipeline_model", root / "held_out", root / "fresh.json"
    model.write().overwrite().save(str(model_path))
    held_out.write.mode("overwrite").parquet(str(rows_path))
    here = {r["image_id"]: (r["prediction"], list(r["p"])) for r in model.transform(spark.read.parquet(
        str(rows_path))).select("image_id", "prediction", vector_to_array("probability").alias("p")).collect()}

    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", FRESH_SESSION, str(model_path), str(rows_path), str(out_path)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    fresh = json.loads(out_path.read_text())
    assert fresh["stages"] == ["pyspark.ml.feature.VectorAssembler", "pipeline.spark_ml.ShardlineModel"]
    there = {int(k): v for k, v in fresh["rows"].items()}
    assert set(there) == set(here) and len(here) == 360
    assert all(there[i][0] == here[i][0] for i in here)
    np.testing.assert_allclose(np.array([there[i][1] for i in sorted(here)]),
                               np.array([here[i][1] for i in sorted(here)]), atol=1e-6, rtol=0)


def test_saved_model_state_is_plain_data(fitted):
    model, _, root = fitted
    path = root / "pipeline_model_state"
    model.write().overwrite().save(str(path))
    state_dirs = list(path.glob("stages/*/shardline"))
    assert len(state_dirs) == 1
    files = sorted(p.name for p in state_dirs[0].iterdir())
    assert files == ["parameters.f32", "state.json"]
    info = json.loads((state_dirs[0] / "state.json").read_text())
    assert info["spec"]["num_features"] == 64 and info["labels"] == [str(i) for i in range(10)]
    assert (state_dirs[0] / "parameters.f32").stat().st_size == 4 * info["num_parameters"]


def test_estimator_params_round_trip(spark, tmp_path):
    from pipeline.spark_ml import ShardlineEstimator

    estimator = ShardlineEstimator(featuresCol="v", labelCol="y", parallelism=3, epochs=2,
                                   overrides=["ps.mode=async"], configPath=str(REPO / "conf" / "digits.yaml"))
    estimator.save(str(tmp_path / "estimator"))
    loaded = ShardlineEstimator.load(str(tmp_path / "estimator"))
    assert loaded.uid == estimator.uid
    assert (loaded.getFeaturesCol(), loaded.getLabelCol(), loaded.getOverrides()) == ("v", "y", ["ps.mode=async"])
    cfg = loaded.pipeline_config()
    assert (cfg.name, cfg.parallelism.data, cfg.train.epochs, cfg.ps.mode) == ("digits", 3, 2, "async")
    assert cfg.model.hidden == [128, 64]  # from conf/digits.yaml


def test_pandas_udf_fallback_scores_like_the_arrow_udf(fitted, monkeypatch):
    """pyspark < 4.1 has no `arrow_udf`: transform falls back to an iterator pandas_udf, same results."""
    import pyspark.sql.functions as functions

    model, held_out, _ = fitted
    select = ["image_id", "prediction", "probability"]
    arrow = {r["image_id"]: (r["prediction"], r["probability"].toArray()) for r in
             model.transform(held_out).select(*select).collect()}
    if hasattr(functions, "arrow_udf"):
        monkeypatch.delattr(functions, "arrow_udf")
    pandas = {r["image_id"]: (r["prediction"], r["probability"].toArray()) for r in
              model.transform(held_out).select(*select).collect()}
    assert set(arrow) == set(pandas)
    assert all(arrow[i][0] == pandas[i][0] for i in arrow)
    np.testing.assert_allclose(np.array([pandas[i][1] for i in sorted(arrow)]),
                               np.array([arrow[i][1] for i in sorted(arrow)]), atol=1e-6, rtol=0)
