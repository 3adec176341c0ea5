"""Metrics of a model on a split of the shard set, computed in Spark."""
from pipeline.evaluate.metrics import EvalResult
from pipeline.evaluate.spark_eval import evaluate

__all__ = ["EvalResult", "evaluate"]
