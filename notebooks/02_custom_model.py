# Databricks notebook source
# MAGIC %md
# MAGIC # Train your own model
# MAGIC `model.factory: "module:function"` replaces the built-in MLP. The function is called as
# MAGIC `function(num_features=..., num_outputs=..., **model.factory_kwargs)` on the driver and on every
# MAGIC executor and returns a `torch.nn.Module`, so its module must be importable on both. Here it is
# MAGIC `custom_models.py` next to this notebook (on the driver's `sys.path`), shipped to the executors
# MAGIC with `ship_module` (`SparkContext.addPyFile`). On a cluster you can instead install it as a library.
# MAGIC Runs as a plain script too: `python notebooks/02_custom_model.py`.

# COMMAND ----------

from pipeline.notebook import widget

config_path = widget("config", "conf/digits.yaml", globals().get("dbutils"))
workers = widget("workers", "2", globals().get("dbutils"))
epochs = widget("epochs", "5", globals().get("dbutils"))
factory_kwargs = widget("factory_kwargs", "{width: 64, blocks: 2}", globals().get("dbutils"))
extra = widget("overrides", "", globals().get("dbutils"))

# COMMAND ----------

from pipeline.cli import configure_logging
from pipeline.config import load
from pipeline.session import get_or_create_spark

configure_logging("INFO")
cfg = load(config_path, [f"parallelism.data={workers}", f"train.epochs={epochs}",
                         "model.factory=custom_models:residual_mlp", f"model.factory_kwargs={factory_kwargs}",
                         *extra.split()])
spark = get_or_create_spark(cfg.spark)

# COMMAND ----------

# MAGIC %md ## The factory: import it here, ship it to the executors

# COMMAND ----------

import custom_models
from pipeline.notebook import ship_module

ship_module(spark, custom_models)
print(custom_models.residual_mlp(num_features=64, num_outputs=10, **cfg.model.factory_kwargs))

# COMMAND ----------

# MAGIC %md ## ETL, then train, evaluate and track the custom model

# COMMAND ----------

from pipeline import steps

outcome = steps.run_all(spark, cfg)
print("mlflow run id:", outcome.run_id)
print("model:", outcome.model_uri)
print("test metrics:", outcome.test_metrics)
