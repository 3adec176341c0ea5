# Databricks notebook source
# MAGIC %md
# MAGIC # shardline quickstart
# MAGIC Spark ETL of the handwritten digits into balanced shards, 2 barrier workers synchronized by the
# MAGIC driver's parameter server, evaluation in Spark, and one MLflow run with everything in it.
# MAGIC Runs in Databricks (widgets) and as a plain script: `python notebooks/01_quickstart.py`.

# COMMAND ----------

from pipeline.notebook import widget

config_path = widget("config", "conf/digits.yaml", globals().get("dbutils"))
workers = widget("workers", "2", globals().get("dbutils"))
epochs = widget("epochs", "5", globals().get("dbutils"))
extra = widget("overrides", "", globals().get("dbutils"))

# COMMAND ----------

from pipeline.cli import configure_logging
from pipeline.config import load
from pipeline.session import get_or_create_spark

configure_logging("INFO")
cfg = load(config_path, [f"parallelism.data={workers}", f"train.epochs={epochs}", *extra.split()])
spark = get_or_create_spark(cfg.spark)

# COMMAND ----------

# MAGIC %md ## ETL: source → clean → split → standardize → shards

# COMMAND ----------

from pipeline import steps

manifest = steps.etl(spark, cfg)
print({name: split.rows for name, split in manifest.splits.items()})

# COMMAND ----------

# MAGIC %md ## Train, evaluate, track

# COMMAND ----------

outcome = steps.train_and_evaluate(spark, cfg, manifest)
print("mlflow run id:", outcome.run_id)
print("test metrics:", outcome.test_metrics)
