"""Evaluate a model on a split of the shard set inside Spark.

Each partition rebuilds the model once from plain values (the spec, and the weights as a broadcast
variable), scores its Arrow batches, and returns one row of additive partial sums; the driver adds the
rows up. No prediction rows travel back to the driver.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from pipeline.data.arrow_read import shard_columns
from pipeline.evaluate.metrics import (EvalResult, classification_metrics, classification_partials,
                                       regression_metrics, regression_partials)
from pipeline.errors import DataError
from pipeline.models import ModelSpec
from pipeline.shards import Manifest
from pipeline.storage.spark_io import read_parquet

log = logging.getLogger(__name__)


class _Inline:
    """Stands in for a broadcast where a session has no SparkContext (Spark Connect): the value then
    travels inside the task closure."""

    def __init__(self, value):
        self.value = value

    def unpersist(self) -> None:
        pass


def _broadcast(spark, value):
    try:
        context = spark.sparkContext
    except Exception:  # Spark Connect sessions have no SparkContext
        return _Inline(value)
    return context.broadcast(value)


def _make_partials_fn(spec_dict: dict, weights, features_field: str, label_field: str,
                      num_features: int, num_classes: int | None):
    def score(batches):
        import warnings

        import pyarrow as pa
        import torch

        from pipeline.data.arrow_read import feature_arrays
        from pipeline.models import ModelSpec, build_model, load_flat_state

        spec = ModelSpec.from_dict(spec_dict)
        features = spec.feature_set
        model = build_model(spec)
        load_flat_state(model, torch.from_numpy(weights.value))
        model.eval()
        total = None
        with torch.no_grad():
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                table = pa.Table.from_batches([batch])
                x = feature_arrays(table, features, features_field, "the evaluated split", 0, num_features)
                y = batch.column(label_field).to_numpy(zero_copy_only=False)
                with warnings.catch_warnings():  # Arrow buffers are read-only; the model only reads them
                    warnings.simplefilter("ignore", UserWarning)
                    inputs = {key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in x.items()}
                out = model(inputs).numpy()
                part = (classification_partials(out, y.astype(np.int64), num_classes) if num_classes
                        else regression_partials(out.reshape(-1), y.astype(np.float64)))
                total = part if total is None else total + part
        if total is not None:
            yield pa.RecordBatch.from_arrays([pa.array([total.tolist()], pa.list_(pa.float64()))], names=["partial"])

    return score


def evaluate(spark, manifest: Manifest, spec: ModelSpec, parameters, split: str = "test") -> EvalResult:
    """Loss and metrics of the model with `parameters` on `split`: classification or regression."""
    started = time.perf_counter()
    files = manifest.files(split)
    rows = manifest.split(split).rows
    if not files or rows == 0:
        raise DataError(f"the {split} split of {manifest.root} is empty; nothing to evaluate "
                        f"(raise data.split.{split})")
    weights = parameters.detach().cpu().numpy().astype(np.float32) if hasattr(parameters, "detach") \
        else np.asarray(parameters, dtype=np.float32)
    num_classes = manifest.num_classes if manifest.task == "classification" else None
    shipped = _broadcast(spark, weights)
    fn = _make_partials_fn(spec.to_dict(), shipped, manifest.features_field, manifest.label_field,
                           manifest.num_features, num_classes)
    try:
        columns = shard_columns(manifest.feature_set, manifest.features_field) + [manifest.label_field]
        partials = read_parquet(spark, files, columns).mapInArrow(fn, "partial array<double>").collect()
    finally:
        shipped.unpersist()
    total = np.sum([np.asarray(r["partial"]) for r in partials], axis=0)
    if manifest.task == "classification":
        metrics, confusion = classification_metrics(total, num_classes)
        result = EvalResult(split, int(total[1]), metrics, confusion, list(manifest.label_mapping))
    else:
        result = EvalResult(split, int(total[-1]), regression_metrics(total))
    if result.rows != rows:
        raise DataError(f"evaluated {result.rows} rows of the {split} split but the manifest lists {rows}; "
                        "the shard set changed on disk — re-run `shardline etl`")
    log.info("evaluation on %s (%d rows, %.1fs): %s", split, result.rows, time.perf_counter() - started,
             ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items()))
    return result
