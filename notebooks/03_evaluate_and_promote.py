# Databricks notebook source
# MAGIC %md
# MAGIC # Evaluate the last trained model and promote it
# MAGIC Scores the model the last `train` step of this config saved (in Spark, on the test split, logged
# MAGIC into that training's MLflow run), then promotes it in the MLflow Model Registry (registered model
# MAGIC `tracking.registered_model`, default the config's `name`): it becomes the `champion` if its test
# MAGIC accuracy beats the current champion's (or there is none yet). A fresh workdir gets a short
# MAGIC training first.
# MAGIC Runs as a plain script too: `python notebooks/03_evaluate_and_promote.py`.

# COMMAND ----------

from pipeline.notebook import widget

config_path = widget("config", "conf/digits.yaml", globals().get("dbutils"))
workers = widget("workers", "2", globals().get("dbutils"))
epochs = widget("epochs", "3", globals().get("dbutils"))
extra = widget("overrides", "", globals().get("dbutils"))

# COMMAND ----------

from pipeline.cli import configure_logging
from pipeline.config import load
from pipeline.session import get_or_create_spark

configure_logging("INFO")
cfg = load(config_path, [f"parallelism.data={workers}", f"train.epochs={epochs}", *extra.split()])
spark = get_or_create_spark(cfg.spark)

# COMMAND ----------

from pipeline import steps

if not (steps.model_dir(cfg) / "model.pt").exists():  # nothing trained with this config yet
    steps.etl(spark, cfg)
    steps.train(spark, cfg)

# COMMAND ----------

# MAGIC %md ## Evaluate (metrics go into the training's MLflow run as `test_*`)

# COMMAND ----------

evaluation = steps.evaluate(spark, cfg)
print("mlflow run id:", evaluation.run_id)
print("test metrics:", evaluation.test_metrics)

# COMMAND ----------

# MAGIC %md ## Promote
# MAGIC `steps.promote` scores this model and the registered model's current `champion` on the same test
# MAGIC rows, registers this one as a new version and gives it the alias `champion` if it wins by more
# MAGIC than `workflow.margin` on `workflow.metric` (accuracy), else `challenger`.

# COMMAND ----------

promotion = steps.promote(spark, cfg)
name = steps.registered_name(cfg)
print(f"{name} version {promotion.version} -> {promotion.alias} (models:/{name}@{promotion.alias})")
print("reason:", promotion.reason)
