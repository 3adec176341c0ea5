"""Batch scoring body for `DataFrame.mapInArrow`: raw columns -> the Transform -> the model -> label values.

Everything arrives as plain values captured in the closure (the fitted FeatureSpec dicts, the vocabularies
as Arrow string arrays, the model spec as a dict, the flat fp32 parameters as bytes, the label values),
plus `build_model`, a callable `(spec_dict, parameters_bytes) -> torch.nn.Module` passed in by the caller.
The model is built once per Python worker process (a module-level cache keyed by a digest of spec +
parameters), so every task that worker runs, and every batch, reuses it. Preprocessing is
udfs.transforms.Transform, the one raw-columns -> batch implementation the ETL and the served model use:
vectorized over the Arrow batch (numeric-only feature sets never make a Python object per row), with
PIL per image for image features.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa

from udfs.transforms import Transform, take_rows

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


def forward(model, arrays: Mapping[str, np.ndarray], batch_size: int, classification: bool,
            probabilities: bool) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(class indices int64 [n] or outputs float64 [n], softmax float32 [n, k] or None) in slices of
    `batch_size` rows."""
    import torch

    rows = len(next(iter(arrays.values()))) if arrays else 0
    outputs, probs = [], []
    with torch.inference_mode():
        for start in range(0, rows, batch_size):
            batch = {k: torch.from_numpy(np.ascontiguousarray(v[start:start + batch_size])) for k, v in arrays.items()}
            out = model(batch)
            if classification:
                outputs.append(out.argmax(dim=1).numpy())
                if probabilities:
                    probs.append(torch.softmax(out, dim=1).to(torch.float32).numpy())
            else:
                outputs.append(out.reshape(-1).to(torch.float64).numpy())
    if not outputs:
        return np.empty(0, np.int64 if classification else np.float64), None
    return np.concatenate(outputs), (np.concatenate(probs) if probs else None)


def make_score_fn(
    specs: Sequence[Mapping[str, Any]],
    vocabularies: Mapping[str, pa.Array],
    build_model: Callable[[Mapping[str, Any], bytes], Any],
    spec: Mapping[str, Any],
    parameters: bytes,
    digest: str,
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
    """Build the mapInArrow body. Input batches hold keep_columns and each feature's raw column (named
    like the feature).

    Output columns: keep_columns (unchanged), `prediction` (classification: the original label value of the
    argmax class, typed `label_type`; regression: float64) and, for classification with `probabilities`,
    `probability` (array<float>, softmax in class-index order). invalid_rows: `drop` leaves rows the
    Transform finds invalid out, `keep_null` writes them with null prediction/probability, `reject` raises on
    the first one (the driver checks before scoring, so this is a guard). `counter.add([input rows, scored
    rows, invalid rows, invalid values per feature...])` once per partition when a counter is given.
    """
    specs = [dict(s) for s in specs]
    names = [s["name"] for s in specs]
    vocabularies = dict(vocabularies)
    keep = list(keep_columns)
    classification = task == "classification"
    labels = pa.array(list(label_values), label_type) if classification else None
    spec = dict(spec)

    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        model = cached_model(digest, lambda: build_model(spec, parameters))
        transform = Transform(specs, vocabularies)
        counts = np.zeros(3 + len(names), dtype=np.int64)
        for batch in batches:
            if batch.num_rows == 0:
                continue
            counts[0] += batch.num_rows
            arrays, valid, by_column, image_error = transform.apply(batch)
            n_bad = int(batch.num_rows - valid.sum())
            if n_bad:
                counts[2] += n_bad
                counts[3:] += np.asarray([by_column.get(n, 0) for n in names], dtype=np.int64)
                if invalid_rows == "reject":
                    raise ValueError(f"score.invalid_rows=reject: {n_bad} invalid rows (per column {by_column})"
                                     + (f"; first image error: {image_error}" if image_error else ""))
                arrays = take_rows(arrays, valid)
            predicted, probs = forward(model, arrays, batch_size, classification, probabilities)
            counts[1] += len(predicted)
            if invalid_rows == "drop" and n_bad:
                out_batch, positions = batch.filter(pa.array(valid)), None
            elif n_bad:  # keep_null: every input row, nulls where the features were invalid
                out_batch, positions = batch, np.flatnonzero(valid)
            else:
                out_batch, positions = batch, None
            columns = [out_batch.column(c) for c in keep]
            fields = list(keep)
            prediction = labels.take(pa.array(predicted, pa.int64())) if classification \
                else pa.array(predicted, pa.float64())
            columns.append(_spread(prediction, positions, batch.num_rows))
            fields.append(PREDICTION)
            if classification and probabilities:
                width = len(labels)
                flat = pa.array((probs if probs is not None else np.empty((0, width), np.float32)).reshape(-1),
                                pa.float32())
                prob = pa.ListArray.from_arrays(
                    pa.array(np.arange(0, len(flat) + 1, width, dtype=np.int32)), flat)
                columns.append(_spread(prob, positions, batch.num_rows))
                fields.append(PROBABILITY)
            yield pa.RecordBatch.from_arrays(columns, names=fields)
        if counter is not None:
            counter.add(counts.tolist())

    return score


def make_validity_fn(specs: Sequence[Mapping[str, Any]], vocabularies: Mapping[str, pa.Array]):
    """A mapInArrow body yielding one row per partition, `rows long, invalid long, by_column array<long>`
    (invalid values per feature, in spec order): the reject pre-pass for feature sets Spark SQL cannot
    check (imputed numerics, vectors, images)."""
    specs = [dict(s) for s in specs]
    names = [s["name"] for s in specs]
    vocabularies = dict(vocabularies)

    def count(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        transform = Transform(specs, vocabularies)
        rows, invalid, by_column = 0, 0, np.zeros(len(names), dtype=np.int64)
        for batch in batches:
            if batch.num_rows == 0:
                continue
            _, valid, counts, _ = transform.apply(batch)
            rows += batch.num_rows
            invalid += int(batch.num_rows - valid.sum())
            by_column += np.asarray([counts.get(n, 0) for n in names], dtype=np.int64)
        yield pa.RecordBatch.from_arrays(
            [pa.array([rows], pa.int64()), pa.array([invalid], pa.int64()),
             pa.array([by_column.tolist()], pa.list_(pa.int64()))], names=["rows", "invalid", "by_column"])

    return count


def spark_input(df, spec: Mapping[str, Any]):
    """(the Spark column of `df` the Transform reads for feature `spec`, None) or (None, what the feature
    needs) when the column's type does not fit: numbers as double (text try_cast: non-numbers become an
    invalid or imputed null), categoricals as they are (string/integer/boolean), images as binary (or
    path strings), vectors and Spark ML Vectors as array<double>, text as a string or a token array."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, BinaryType, BooleanType, IntegralType, NumericType, StringType

    name, kind = spec["name"], spec["type"]
    quoted = "`" + name.replace("`", "``") + "`"
    column, dtype = F.col(quoted), df.schema[name].dataType
    element = dtype.elementType if isinstance(dtype, ArrayType) else None
    if kind == "numeric":
        if isinstance(dtype, NumericType):
            return column.cast("double").alias(name), None
        if isinstance(dtype, StringType):
            return F.expr(f"try_cast({quoted} as double)").alias(name), None
        return None, "a number (or text holding one)"
    if kind == "categorical":
        ok = isinstance(dtype, (StringType, IntegralType, BooleanType))
        return (column, None) if ok else (None, "a string or integer column")
    if kind == "vector":
        if isinstance(dtype, VectorUDT):
            return vector_to_array(column, "float64").alias(name), None
        if isinstance(element, NumericType):
            return column.cast("array<double>").alias(name), None
        return None, f"a Spark ML Vector or an array of {spec.get('length')} numbers"
    if kind == "image":
        by_path = spec.get("source") == "path"
        if isinstance(dtype, StringType if by_path else BinaryType):
            return column, None
        return None, "file paths (string)" if by_path else "encoded image bytes (binary)"
    if kind == "text":
        if spec.get("tokenize"):
            return (column, None) if isinstance(dtype, StringType) else (None, "a string column")
        ok = isinstance(element, (IntegralType, StringType))
        return (column, None) if ok else (None, "an array of tokens (integers or strings)")
    return None, f"a known feature type (not {kind!r})"


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
