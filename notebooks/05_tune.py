# Databricks notebook source
# MAGIC %md
# MAGIC # Hyperparameter search with Optuna
# MAGIC An Optuna study over `tune.space` (here the learning rate and the hidden layers), each trial a
# MAGIC shardline training run with barrier workers, nested under one MLflow run for the study. Each
# MAGIC epoch's validation accuracy goes to Optuna as it completes, so the median pruner stops poor trials
# MAGIC early. The study is kept in `<workdir>/optuna.db`: running this notebook again after an
# MAGIC interruption runs only the missing trials. The best trial's config is written to
# MAGIC `<workdir>/tune/<study>/best.yaml` and its model registered as `<name>-tuned`.
# MAGIC Runs as a plain script too: `python notebooks/05_tune.py`; the CLI equivalent is
# MAGIC `shardline tune --config conf/digits.yaml --trials 4`.

# COMMAND ----------

from pipeline.notebook import widget

config_path = widget("config", "conf/digits.yaml", globals().get("dbutils"))
workers = widget("workers", "2", globals().get("dbutils"))
epochs = widget("epochs", "3", globals().get("dbutils"))
trials = widget("trials", "4", globals().get("dbutils"))
extra = widget("overrides", "", globals().get("dbutils"))

# COMMAND ----------

from pipeline.cli import configure_logging
from pipeline.config import load
from pipeline.session import get_or_create_spark

configure_logging("INFO")
space = "tune.space={train.lr: {low: 0.001, high: 0.3, log: true}, model.hidden: {choices: [[32], [128]]}}"
cfg = load(config_path, [f"parallelism.data={workers}", f"train.epochs={epochs}", space, *extra.split()])
spark = get_or_create_spark(cfg.spark)

# COMMAND ----------

# MAGIC %md ## Search (one ETL, then one training run per trial)

# COMMAND ----------

from pipeline.tune import tune

outcome = tune(spark, cfg, trials=int(trials))
print(f"study {outcome.study}: {outcome.trials} trials, {outcome.pruned} pruned")
print("mlflow run id:", outcome.parent_run_id)
print("best value:", round(outcome.best_value, 4), "with", outcome.best_params)
print("best config:", outcome.best_config)
