"""Score a trained model inside a Spark UDF (ShardlineModel.transform), preprocessing with the Transform.

Plain values only cross in: the fitted FeatureSpec dicts, the vocabularies (name -> list of values), the
label values, the task, and a `build` callable that returns the torch module (built once per Python
worker and cached under `key`). The UDF's input is either the classic single features vector (a list
column; its entries are the numeric features f0..fN-1) or a struct of the raw input columns, one per
feature. The wrappers feed Arrow batches (pyspark >= 4.1 `arrow_udf`) or pandas batches (the pandas_udf
fallback) to the same core; a row the Transform finds invalid gets a null result.
"""
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# One model per Python worker, shared with batch scoring's cache (Spark reuses workers between tasks).
from udfs.score import cached_model, forward
from udfs.transforms import Transform, take_rows

RESULT_DDL = "struct<prediction:double,probability:array<double>>"
RESULT_TYPE = pa.struct([("prediction", pa.float64()), ("probability", pa.list_(pa.float64()))])
BATCH_ROWS = 8192


def make_scorer(key: str, build: Callable[[], object], specs: Sequence[Mapping[str, Any]],
                vocabularies: Mapping[str, Sequence[str]], task: str, label_values: Optional[Sequence[float]]):
    """(Arrow table of the features' raw columns) -> (predictions float64 [valid rows], probabilities float64
    [valid rows, k] or None, valid [n])."""
    transform = Transform(specs, {k: pa.array(list(v), pa.string()) for k, v in vocabularies.items()})
    values = None if label_values is None else np.asarray(label_values, dtype=np.float64)
    classification = task == "classification"

    def score(table):
        model = cached_model(key, build)
        arrays, valid, _, _ = transform.apply(table)
        if not valid.all():
            arrays = take_rows(arrays, valid)
        index, prob = forward(model, arrays, BATCH_ROWS, classification, probabilities=classification)
        if not classification:
            return index, None, valid
        prob = prob.astype(np.float64) if prob is not None else np.zeros((0, 0))
        return (values[index] if values is not None else index.astype(np.float64)), prob, valid

    return score


def classic_table(column: pa.Array, names: Sequence[str]) -> pa.Table:
    """A list<double> column of features vectors as a table of one float column per numeric feature (a
    null vector: nulls, an invalid row). A vector of another length is an error: the input is not what
    the model was trained on."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    width = len(names)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    present = column.filter(pa.array(valid)) if not valid.all() else column
    lengths = pc.list_value_length(present).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != width).any():
        bad = int(lengths[lengths != width][0])
        raise ValueError(f"a features vector has {bad} values, the model was trained on {width}")
    matrix = np.full((len(column), width), np.nan)
    matrix[valid] = present.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(-1, width)
    return pa.table({name: pa.array(matrix[:, j]) for j, name in enumerate(names)})


def struct_table(column) -> pa.Table:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return pa.Table.from_arrays(column.flatten(), names=[f.name for f in column.type])


def _result_array(pred: np.ndarray, prob: Optional[np.ndarray], valid: np.ndarray) -> pa.StructArray:
    n = len(valid)
    full_pred = np.zeros(n, dtype=np.float64)
    full_pred[valid] = pred
    mask = pa.array(~valid)
    prediction = pa.array(full_pred, pa.float64(), mask=~valid)
    if prob is None:
        probability = pa.nulls(n, pa.list_(pa.float64()))
    else:
        k = prob.shape[1] if len(prob) else 0
        rows = np.zeros((n, k), dtype=np.float64)
        rows[valid] = prob
        offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32) if k else np.zeros(n + 1, np.int32))
        probability = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)), mask=mask)
    return pa.StructArray.from_arrays([prediction, probability], fields=list(RESULT_TYPE), mask=mask)


def _table_of(column, classic: Optional[Sequence[str]]) -> pa.Table:
    return classic_table(column, classic) if classic is not None else struct_table(column)


def make_arrow_predict_fn(scorer, classic: Optional[Sequence[str]] = None):
    """Iterator[pa.Array] -> Iterator[pa.Array] body for `arrow_udf` (pyspark >= 4.1). `classic`: the
    numeric feature names of a features-vector input; None: the input is a struct of raw columns."""

    def predict(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        for column in batches:
            pred, prob, valid = scorer(_table_of(column, classic))
            yield _result_array(pred, prob, valid)

    return predict


def make_pandas_predict_fn(scorer, classic: Optional[Sequence[str]] = None):
    """Iterator[pd.Series] (classic vectors) or Iterator[pd.DataFrame] (a struct of raw columns) ->
    Iterator[pd.DataFrame] body for `pandas_udf` (older pyspark), which reads its kind off the hints."""
    import pandas as pd

    def result(table: pa.Table) -> pd.DataFrame:
        pred, prob, valid = scorer(table)
        out = _result_array(pred, prob, valid)
        return pd.DataFrame({"prediction": out.field("prediction").to_pandas(),
                             "probability": out.field("probability").to_pandas()})

    def predict_vectors(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        for series in batches:
            yield result(classic_table(pa.array(list(series), type=pa.list_(pa.float64()), from_pandas=True),
                                       classic))

    def predict_columns(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for frame in batches:
            yield result(pa.Table.from_pandas(frame, preserve_index=False))

    return predict_vectors if classic is not None else predict_columns
