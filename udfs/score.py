"""Batch scoring body for `DataFrame.mapInArrow`: standardize, run the model, map classes back to labels.

Everything arrives as plain values captured in the closure (feature names, the model spec as a dict, the
flat fp32 parameters as bytes, the training means/stds, the label values), plus `build_model`, a callable
`(spec_dict, parameters_bytes) -> torch.nn.Module` passed in by the caller. The model is built once per
Python worker process (a module-level cache keyed by a digest of spec + parameters), so every task that
worker runs, and every batch, reuses it. Rows never become Python objects: Arrow columns -> one float32
matrix -> torch -> Arrow columns.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa

PREDICTION = "prediction"
PROBABILITY = "probability"

# digest -> eval-mode torch module, built once per Python worker process.
_MODELS: dict[str, Any] = {}
_MAX_CACHED = 4


def cached_model(digest: str, build: Callable[[], Any]):
    model = _MODELS.get(digest)
    if model is None:
        if len(_MODELS) >= _MAX_CACHED:
            _MODELS.pop(next(iter(_MODELS)))
        model = build()
        model.eval()
        _MODELS[digest] = model
    return model


def invalid_matrix(batch: pa.RecordBatch, columns: Sequence[str]) -> np.ndarray:
    """[rows, columns] booleans: null, NaN or +-inf in each (double) feature column."""
    flags = np.empty((batch.num_rows, len(columns)), dtype=bool)
    for j, name in enumerate(columns):
        column = batch.column(name)
        flags[:, j] = ~np.isfinite(column.to_numpy(zero_copy_only=False))  # nulls come back as NaN
        if column.null_count:
            flags[:, j] |= column.is_null().to_numpy(zero_copy_only=False)
    return flags


def standardized_matrix(batch: pa.RecordBatch, columns: Sequence[str], mean: Optional[np.ndarray],
                        inv_std: Optional[np.ndarray]) -> np.ndarray:
    """The float32 [rows, features] model input, computed exactly as the ETL's pack step does."""
    matrix = np.empty((batch.num_rows, len(columns)), dtype=np.float32)
    for j, name in enumerate(columns):
        column = batch.column(name).to_numpy(zero_copy_only=False)
        matrix[:, j] = column if mean is None else (column - mean[j]) * inv_std[j]
    return matrix


def make_score_fn(
    feature_columns: Sequence[str],
    build_model: Callable[[Mapping[str, Any], bytes], Any],
    spec: Mapping[str, Any],
    parameters: bytes,
    digest: str,
    means: Optional[Sequence[float]],
    stds: Optional[Sequence[float]],
    task: str,
    label_values: Optional[Sequence[Any]],
    label_type: pa.DataType,
    keep_columns: Sequence[str],
    invalid_rows: str,
    batch_size: int,
    threads: int,
    probabilities: bool,
    counter=None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Build the mapInArrow body.

    Output columns: keep_columns (unchanged), `prediction` (classification: the original label value of the
    argmax class, typed `label_type`; regression: float64) and, for classification with `probabilities`,
    `probability` (array<float>, softmax in class-index order). invalid_rows: `drop` leaves rows with a
    null/NaN/inf feature out, `keep_null` writes them with null prediction/probability, `reject` raises on
    the first one (the driver checks before scoring, so this is a guard). `counter.add([input rows, scored
    rows, invalid rows, invalid per feature column...])` once per partition when a counter is given.
    """
    columns = list(feature_columns)
    keep = list(keep_columns)
    mean = None if means is None else np.asarray(means, dtype=np.float64)
    inv_std = None if stds is None else 1.0 / np.asarray(stds, dtype=np.float64)
    classification = task == "classification"
    labels = pa.array(list(label_values), label_type) if classification else None
    spec = dict(spec)

    def predict(model, torch, x: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray]]:
        outputs, probs = [], []
        with torch.inference_mode():
            for start in range(0, x.shape[0], batch_size):
                out = model(torch.from_numpy(x[start:start + batch_size]))
                if classification:
                    outputs.append(out.argmax(dim=1).numpy())
                    if probabilities:
                        probs.append(torch.softmax(out, dim=1).numpy())
                else:
                    outputs.append(out.reshape(-1).to(torch.float64).numpy())
        if not outputs:
            width = len(labels) if classification else 0
            return (np.empty(0, np.int64 if classification else np.float64),
                    np.empty((0, width), np.float32) if probs is not None else None)
        return np.concatenate(outputs), (np.concatenate(probs) if probs else None)

    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        model = cached_model(digest, lambda: build_model(spec, parameters))
        counts = np.zeros(3 + len(columns), dtype=np.int64)
        for batch in batches:
            if batch.num_rows == 0:
                continue
            counts[0] += batch.num_rows
            flags = invalid_matrix(batch, columns)
            bad = flags.any(axis=1)
            n_bad = int(bad.sum())
            if n_bad:
                counts[2] += n_bad
                counts[3:] += flags.sum(axis=0, dtype=np.int64)
                if invalid_rows == "reject":
                    worst = [c for c, n in zip(columns, flags.sum(axis=0)) if n]
                    raise ValueError(f"score.invalid_rows=reject: {n_bad} rows with null/NaN/inf features "
                                     f"(columns {worst})")
            valid = ~bad
            scored = batch if not n_bad else batch.filter(pa.array(valid))
            x = standardized_matrix(scored, columns, mean, inv_std)
            predicted, probs = predict(model, torch, x)
            counts[1] += len(predicted)
            if invalid_rows == "drop" or not n_bad:
                out_batch, positions = scored, None
            else:  # keep_null: every input row, nulls where the features were invalid
                out_batch, positions = batch, np.flatnonzero(valid)
            arrays = [out_batch.column(c) for c in keep]
            names = list(keep)
            if classification:
                prediction = labels.take(pa.array(predicted))
            else:
                prediction = pa.array(predicted, pa.float64())
            arrays.append(_spread(prediction, positions, batch.num_rows))
            names.append(PREDICTION)
            if classification and probabilities:
                flat = pa.array(probs.reshape(-1), pa.float32())
                prob = pa.ListArray.from_arrays(
                    pa.array(np.arange(0, len(flat) + 1, len(labels), dtype=np.int32)), flat)
                arrays.append(_spread(prob, positions, batch.num_rows))
                names.append(PROBABILITY)
            yield pa.RecordBatch.from_arrays(arrays, names=names)
        if counter is not None:
            counter.add(counts.tolist())

    return score


def _spread(values: pa.Array, positions: Optional[np.ndarray], rows: int) -> pa.Array:
    """`values` placed at `positions` of a `rows`-long array, nulls elsewhere (positions None: as is)."""
    if positions is None:
        return values
    if len(values) == 0:
        return pa.nulls(rows, values.type)
    index = np.zeros(rows, dtype=np.int64)
    index[positions] = np.arange(len(positions))
    missing = np.ones(rows, dtype=bool)
    missing[positions] = False
    return values.take(pa.array(index, mask=missing))  # a null index takes a null
