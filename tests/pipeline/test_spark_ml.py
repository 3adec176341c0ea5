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
    with pytest.MonkeyPatch.context() as env:  # an earlier test's tracking URI would make the fit log
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
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


# --- raw typed input columns (inputCols) ---------------------------------------------------------------

CITIES = ["paris", "rome", "oslo", "lima", "kyiv", "baku"]
NORTH = {"oslo", "kyiv", "baku"}


@pytest.fixture(scope="module")
def typed_frame(spark):
    """days (double; a SQLTransformer stage turns it into age) and city (string): the label is whether the
    city is northern, flipped past age 50 — learnable only from both inputs together."""
    import pandas as pd

    rng = np.random.default_rng(3)
    n = 2400
    city = np.array(CITIES)[rng.integers(0, len(CITIES), n)]
    age = rng.uniform(20, 80, n)
    label = (np.isin(city, list(NORTH)) != (age > 50)).astype(np.float64)
    frame = pd.DataFrame({"row": np.arange(n, dtype=np.int64), "days": age * 365.25, "city": city, "label": label})
    return spark.createDataFrame(frame).repartition(2, "row")


@pytest.fixture(scope="module")
def typed_fitted(spark, typed_frame, tmp_path_factory):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import SQLTransformer

    from pipeline.spark_ml import ShardlineEstimator

    root = tmp_path_factory.mktemp("spark-ml-typed")
    estimator = ShardlineEstimator(inputCols=["age", "city"], labelCol="label", workdir=str(root / "work"),
                                   name="typed_ml", parallelism=2, hidden=[32], epochs=8, batchSize=32,
                                   overrides=["train.lr=0.1", "ps.timeout_s=60",
                                              "data.features=[age, {name: city, type: categorical, embedding_dim: 4}]"])
    ages = SQLTransformer(statement="SELECT *, days / 365.25 AS age FROM __THIS__")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        model = Pipeline(stages=[ages, estimator]).fit(typed_frame.where("row % 4 != 0"))
    # Held-out rows with a city never seen in training (scored with the out-of-vocabulary id) and a null one.
    held_out = typed_frame.where("row % 4 = 0").selectExpr(
        "row", "days", "label",
        "CASE WHEN row % 40 = 0 THEN 'utopia' WHEN row % 40 = 20 THEN NULL ELSE city END AS city")
    return model, held_out, root


def _typed_reference(shardline, rows):
    """Transform + the torch model of the fitted stage, in this process: {row: (prediction, probabilities)}."""
    import pyarrow as pa
    import torch

    from udfs.transforms import Transform

    state = shardline._require_state()
    transform = Transform(state["features"], {k: pa.array(v, pa.string()) for k, v in state["vocabularies"].items()})
    table = pa.table({"age": [r["days"] / 365.25 for r in rows], "city": [r["city"] for r in rows]})
    arrays, valid, _, _ = transform.apply(table)
    assert valid.all()
    with torch.no_grad():
        logits = shardline.torch_model()({k: torch.from_numpy(v) for k, v in arrays.items()})
    probabilities = torch.softmax(logits, dim=1).numpy()
    labels = [float(v) for v in shardline.labels]
    return {r["row"]: (labels[int(i)], p) for r, i, p in zip(rows, probabilities.argmax(axis=1), probabilities)}


@pytest.mark.slow
def test_pipeline_fits_numeric_and_categorical_inputs_and_transforms_through_the_transform(typed_fitted, spark):
    from pyspark.ml import PipelineModel

    from pipeline.spark_ml import ShardlineModel

    model, held_out, root = typed_fitted
    shardline = model.stages[-1]
    assert isinstance(shardline, ShardlineModel)
    features = {f["name"]: f for f in shardline._require_state()["features"]}
    assert features["age"]["type"] == "numeric" and features["age"]["standardize"]
    assert features["city"]["type"] == "categorical" and features["city"]["embedding_dim"] == 4
    assert sorted(shardline._require_state()["vocabularies"]["city"]) == sorted(CITIES)
    assert shardline.metrics["accuracy"] >= 0.9, shardline.metrics

    scored = model.transform(held_out).select("row", "days", "city", "label", "prediction", "probability").collect()
    assert len(scored) == 600 and all(r["prediction"] is not None for r in scored)
    known = [r for r in scored if r["city"] in CITIES]
    assert np.mean([r["label"] == r["prediction"] for r in known]) >= 0.9
    reference = _typed_reference(shardline, scored)
    assert all(r["prediction"] == reference[r["row"]][0] for r in scored)
    np.testing.assert_allclose(np.array([r["probability"].toArray() for r in scored]),
                               np.array([reference[r["row"]][1] for r in scored]), atol=1e-6, rtol=0)

    path = root / "typed_pipeline"
    model.write().overwrite().save(str(path))
    info = json.loads(next(path.glob("stages/*/shardline/state.json")).read_text())
    assert info["format"] == 2 and [f["name"] for f in info["features"]] == ["age", "city"]
    again = {r["row"]: r["prediction"] for r in PipelineModel.load(str(path)).transform(held_out).collect()}
    assert again == {r["row"]: r["prediction"] for r in scored}


@pytest.mark.slow
def test_typed_pandas_udf_fallback_scores_like_the_arrow_udf(typed_fitted, monkeypatch):
    import pyspark.sql.functions as functions

    model, held_out, _ = typed_fitted
    arrow = {r["row"]: (r["prediction"], r["probability"].toArray())
             for r in model.transform(held_out).select("row", "prediction", "probability").collect()}
    if hasattr(functions, "arrow_udf"):
        monkeypatch.delattr(functions, "arrow_udf")
    pandas = {r["row"]: (r["prediction"], r["probability"].toArray())
              for r in model.transform(held_out).select("row", "prediction", "probability").collect()}
    assert set(arrow) == set(pandas) and all(arrow[i][0] == pandas[i][0] for i in arrow)
    np.testing.assert_allclose(np.array([pandas[i][1] for i in sorted(arrow)]),
                               np.array([arrow[i][1] for i in sorted(arrow)]), atol=1e-6, rtol=0)


def test_input_columns_of_unknown_kinds_need_a_typed_entry(spark, tmp_path):
    from pipeline.errors import ConfigError, DataError
    from pipeline.spark_ml import ShardlineEstimator

    frame = spark.createDataFrame([(1.0, bytearray(b"png"), "x", 0.0), (2.0, bytearray(b"png"), "y", 1.0)],
                                  "age double, photo binary, city string, label double")
    estimator = ShardlineEstimator(inputCols=["age", "photo"], labelCol="label", workdir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"'photo' has type binary: give it a typed entry.*type: image"):
        estimator.fit(frame)
    with pytest.raises(ConfigError, match=r"data.features names \['city'\], which are not in inputCols"):
        ShardlineEstimator(inputCols=["age"], labelCol="label", workdir=str(tmp_path),
                           overrides=["data.features=[{name: city, type: categorical}]"]).fit(frame)
    with pytest.raises(DataError, match="may not hold the label column"):
        ShardlineEstimator(inputCols=["age", "label"], labelCol="label", workdir=str(tmp_path)).fit(frame)
