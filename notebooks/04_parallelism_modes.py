# Databricks notebook source
# MAGIC %md
# MAGIC # Parallelism modes side by side
# MAGIC The same shard set trained briefly under each way of synchronizing the workers: the driver's
# MAGIC parameter server in `sync` (BSP), `async`, `ssp` (bounded staleness) and `average` (local SGD)
# MAGIC mode, `allreduce` (torch.distributed DDP between the barrier tasks), and `pipeline` (the model cut
# MAGIC into one stage per task, GPipe micro-batches; per-stage bubble logged). One MLflow run each; the
# MAGIC table compares the last epoch's throughput (samples/s over all workers; the first epoch also pays
# MAGIC for starting the workers) and validation accuracy, and each run's whole training time.
# MAGIC Runs as a plain script too: `python notebooks/04_parallelism_modes.py`.

# COMMAND ----------

from pipeline.notebook import widget

config_path = widget("config", "conf/digits.yaml", globals().get("dbutils"))
workers = widget("workers", "2", globals().get("dbutils"))
epochs = widget("epochs", "2", globals().get("dbutils"))
modes = widget("modes", "sync,async,ssp,average,allreduce,pipeline", globals().get("dbutils"))
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

# MAGIC %md ## Train under each mode
# MAGIC `allreduce` is `train.backend=allreduce`; `pipeline` is one replica cut into as many stages as there
# MAGIC are workers (`parallelism.pipeline`, 4 micro-batches; no per-epoch validation: no task holds the
# MAGIC whole model); the others are `ps.mode=...`.

# COMMAND ----------

from mlflow import MlflowClient

results = []
for mode in modes.split(","):
    overrides = {"allreduce": ["train.backend=allreduce"],
                 # one replica, so one train shard: its own shard set (name) and ETL
                 "pipeline": [f"name={cfg.name}-pipeline", "parallelism.data=1", f"parallelism.pipeline={workers}",
                              "parallelism.micro_batches=4"]}
    mode_cfg = load(config_path, [*common, *overrides.get(mode, [f"ps.mode={mode}"]), f"tracking.run_name=mode-{mode}"])
    if mode == "pipeline":
        steps.etl(spark, mode_cfg)
    outcome = steps.train(spark, mode_cfg)
    metrics = MlflowClient(outcome.tracking_uri).get_run(outcome.run_id).data.metrics
    results.append({"mode": mode, "samples_per_s": metrics["samples_per_s"], "val_accuracy": metrics.get("val_accuracy"),
                    "bubble": metrics.get("stage0/bubble_fraction"), "train_seconds": outcome.train_seconds,
                    "run_id": outcome.run_id})

# COMMAND ----------

import pandas as pd

comparison = pd.DataFrame(results).set_index("mode")
print(comparison.to_string(float_format="{:.3f}".format))
