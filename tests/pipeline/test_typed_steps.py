"""Every feature type end to end through the user-facing steps: ETL -> training -> Spark evaluation ->
the MLflow model, loaded with pyfunc and predicting from the RAW named source columns."""
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipeline import steps
from pipeline.config import with_changes
from pipeline.etl.split import SPLIT_COLUMN, assign_split
from tests.pipeline.typed_data import typed_config, write_typed_source

pytestmark = pytest.mark.slow


def test_the_served_model_reproduces_the_spark_evaluation_from_raw_rows(spark, conf_dir, tmp_path):
    import mlflow

    source = write_typed_source(tmp_path / "src")
    cfg = with_changes(typed_config(conf_dir, tmp_path, source, name="typed-steps"),
                       train={"epochs": 6, "optimizer": "adam", "lr": 0.01},
                       tracking={"uri": f"sqlite:///{tmp_path}/mlflow.db", "system_metrics_interval_s": None})
    outcome = steps.run_all(spark, cfg)
    assert outcome.test_metrics["accuracy"] >= 0.9

    # The test split's rows as they are in the source: strings, bytes, lists, nulls and all.
    test_ids = {r["id"] for r in assign_split(spark.read.parquet(source), ["id"], cfg.data.split)
                .where(f"{SPLIT_COLUMN} = 'test'").select("id").collect()}
    raw = pq.read_table(source).to_pandas()
    raw = raw[raw["id"].isin(test_ids)].reset_index(drop=True)
    model = mlflow.pyfunc.load_model(outcome.model_uri)
    inputs = model.metadata.get_input_schema().input_names()
    assert inputs == ["amount", "city", "shop", "vec", "img", "title"]
    predicted = model.predict(raw[inputs])
    assert len(predicted) == len(raw)
    accuracy = float((predicted["prediction"].to_numpy() == raw["label"].to_numpy()).mean())
    assert accuracy == pytest.approx(outcome.test_metrics["accuracy"], abs=1e-9)
    probabilities = np.stack(predicted["probability"].to_numpy())
    assert probabilities.shape == (len(raw), 2) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-5)

    # An undecodable image is refused, naming the column and the count.
    broken = raw[inputs].head(3).copy()
    broken.loc[1, "img"] = b"not an image"
    with pytest.raises(Exception, match=r"img"):
        model.predict(pd.DataFrame(broken))
