"""The quickstart notebook runs as a plain script (widgets fall back to env/defaults)."""
import os
import runpy

import pytest

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "quickstart.py")


def test_notebook_is_databricks_source_format():
    text = open(NOTEBOOK).read()
    assert text.startswith("# Databricks notebook source\n")
    assert text.count("# COMMAND ----------") >= 3


@pytest.mark.slow
def test_quickstart_runs_as_a_script(spark, monkeypatch, conf_dir, tmp_path):
    monkeypatch.setenv("SHARDLINE_WIDGET_CONFIG", f"{conf_dir}/digits.yaml")
    monkeypatch.setenv("SHARDLINE_WIDGET_EPOCHS", "3")
    monkeypatch.setenv("SHARDLINE_WIDGET_OVERRIDES",
                       f"workdir={tmp_path} tracking.uri=sqlite:///{tmp_path}/mlflow.db tracking.log_model=false")
    namespace = runpy.run_path(NOTEBOOK, run_name="__main__")
    outcome = namespace["outcome"]
    assert namespace["cfg"].train.epochs == 3
    assert outcome.run_id and outcome.test_metrics["accuracy"] > 0.8
