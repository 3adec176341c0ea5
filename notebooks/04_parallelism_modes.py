# Databricks notebook source
# MAGIC %md
# MAGIC # Parallelism modes side by side
# MAGIC The same shard set trained briefly under each way of synchronizing the workers: the driver's
# MAGIC parameter server in `sync` (BSP), `async`, `ssp` (bounded staleness) and `average` (local SGD)
# MAGIC mode, and `allreduce` (torch.distributed DDP between the barrier tasks). One MLflow run each; the
# MAGIC table compares the last epoch's throughput (samples/s over all workers; the first epoch also pays
# MAGIC for starting the workers) and validation accuracy, and each run's whole training time.
# MAGIC Runs as a plain script too: `python notebooks/04_parallelism_modes.py`.

# COMMAND ----------

from pipeline.notebook import widget

config_path = widget("config", "conf/digits.yaml", globals().get("dbutils"))
workers = widget("workers", "2", globals().get("dbutils"))
epochs = widget("epochs", "2", globals().get("dbutils"))
modes = widget("modes", "sync,async,ssp,average,allreduce", globals().get("dbutils"))
extra = widget("overrides", "", globals().get("dbutils"))

# COMMAND ----------

from pipeline.cli import configure_logging
from pipeline.config import load
from pipeline.session import get_or_create_spark

configure_logging("INFO")
common = [f"parallelism.data={workers}", f"train.epochs={epochs}", "tracking.log_model=false", *extra.split()]
cfg = load(config_path, common)
spark = get_or_create_spark(cfg.spark)

# COMMAND ----------

# MAGIC %md ## ETL once

# COMMAND ----------

from pipeline import steps

manifest = steps.etl(spark, cfg)
print({name: split.rows for name, split in manifest.splits.items()})

# COMMAND ----------

# MAGIC %md ## Train under each mode (`allreduce` is `train.backend=allreduce`, the others `ps.mode=...`)

# COMMAND ----------

from mlflow import MlflowClient

results = []
for mode in modes.split(","):
    override = "train.backend=allreduce" if mode == "allreduce" else f"ps.mode={mode}"
    outcome = steps.train(spark, load(config_path, [*common, override, f"tracking.run_name=mode-{mode}"]))
    metrics = MlflowClient(outcome.tracking_uri).get_run(outcome.run_id).data.metrics
    results.append({"mode": mode, "samples_per_s": metrics["samples_per_s"], "val_accuracy": metrics["val_accuracy"],
                    "train_seconds": outcome.train_seconds, "run_id": outcome.run_id})

# COMMAND ----------

import pandas as pd

comparison = pd.DataFrame(results).set_index("mode")
print(comparison.to_string(float_format="{:.3f}".format))
