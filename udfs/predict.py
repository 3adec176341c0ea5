"""Score a trained model on a float32 feature matrix inside a Spark UDF (ShardlineModel.transform).

Plain values only cross in: the manifest statistics, the label values, the task, and a `build` callable
that returns the torch module (built once per Python worker and cached under `key`). The wrappers feed
Arrow batches (pyspark >= 4.1 `arrow_udf`) or pandas batches (the pandas_udf fallback) to the same core.
"""
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# One model per Python worker, shared with batch scoring's cache (Spark reuses workers between tasks).
from udfs.score import cached_model

RESULT_DDL = "struct<prediction:double,probability:array<double>>"
RESULT_TYPE = pa.struct([("prediction", pa.float64()), ("probability", pa.list_(pa.float64()))])


def make_scorer(key: str, build: Callable[[], object], means: Sequence[float], stds: Sequence[float],
                task: str, label_values: Optional[Sequence[float]]):
    """(float32 matrix [n, num_features]) -> (predictions float64 [n], probabilities float64 [n, k] or None)."""
    num_features = len(means)
    mean = np.asarray(means, dtype=np.float32)
    inv_std = (1.0 / np.asarray(stds, dtype=np.float64)).astype(np.float32)
    values = None if label_values is None else np.asarray(label_values, dtype=np.float64)

    def score(x: np.ndarray):
        import torch

        if x.ndim != 2 or x.shape[1] != num_features:
            raise ValueError(f"the features vectors have {x.shape[-1] if x.ndim == 2 else '?'} values, the "
                             f"model was trained on {num_features}")
        model = cached_model(key, build)
        z = np.ascontiguousarray((x - mean) * inv_std, dtype=np.float32)
        with torch.no_grad():
            out = model(torch.from_numpy(z))
            if task == "classification":
                prob = torch.softmax(out, dim=1).numpy().astype(np.float64)
                index = prob.argmax(axis=1)
                return (values[index] if values is not None else index.astype(np.float64)), prob
            return out.reshape(-1).numpy().astype(np.float64), None

    return score


def _matrix_from_arrow(column: pa.Array, num_features: int):
    """A list<float> Arrow column -> (float32 matrix of the non-null rows, validity mask)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    present = column.filter(pa.array(valid)) if not valid.all() else column
    lengths = pc.list_value_length(present).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != num_features).any():
        bad = int(lengths[lengths != num_features][0])
        raise ValueError(f"a features vector has {bad} values, the model was trained on {num_features}")
    flat = present.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(-1, num_features), valid


def _result_array(pred: np.ndarray, prob: Optional[np.ndarray], valid: np.ndarray) -> pa.StructArray:
    n = len(valid)
    full_pred = np.zeros(n, dtype=np.float64)
    full_pred[valid] = pred
    mask = pa.array(~valid)
    prediction = pa.array(full_pred, pa.float64(), mask=~valid)
    if prob is None:
        probability = pa.nulls(n, pa.list_(pa.float64()))
    else:
        k = prob.shape[1]
        rows = np.zeros((n, k), dtype=np.float64)
        rows[valid] = prob
        offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
        probability = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)), mask=mask)
    return pa.StructArray.from_arrays([prediction, probability], fields=list(RESULT_TYPE), mask=mask)


def make_arrow_predict_fn(scorer, num_features: int):
    """Iterator[pa.Array] -> Iterator[pa.Array] body for `arrow_udf` (pyspark >= 4.1)."""

    def predict(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        for column in batches:
            x, valid = _matrix_from_arrow(column, num_features)
            pred, prob = scorer(x) if len(x) else (np.zeros(0), None)
            yield _result_array(pred, prob, valid)

    return predict


def make_pandas_predict_fn(scorer, num_features: int):
    """Iterator[pd.Series] -> Iterator[pd.DataFrame] body for `pandas_udf` (older pyspark)."""
    import pandas as pd

    def predict(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        for series in batches:
            column = pa.array(list(series), type=pa.list_(pa.float32()), from_pandas=True)
            x, valid = _matrix_from_arrow(column, num_features)
            pred, prob = scorer(x) if len(x) else (np.zeros(0), None)
            result = _result_array(pred, prob, valid)
            yield pd.DataFrame({"prediction": result.field("prediction").to_pandas(),
                                "probability": result.field("probability").to_pandas()})

    return predict
