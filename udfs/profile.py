"""One-pass data profile per partition: row and invalid counts, split sizes, train moments, label values.

The body runs under `DataFrame.mapInArrow` and returns a single summary row per partition, so the ETL
learns everything it needs before packing (counts for the report, per-partition split sizes for shard
balancing, train-only mean/variance for standardization, the label set) from one read of the source.
Moments are merged with Chan's parallel update (count, mean, M2), which stays accurate on large sums
where a sum-of-squares formula loses precision.
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SPLITS = ("train", "validation", "test")
# Distinct out-of-set label values each partition reports, as examples for the error message.
MAX_LABEL_EXAMPLES = 5


def output_schema_ddl() -> str:
    return ("pid int, rows bigint, bad_rows bigint, bad array<bigint>, nonnum array<bigint>, "
            "split_rows array<bigint>, train_count bigint, train_mean array<double>, train_m2 array<double>, "
            "labels array<string>, labels_truncated boolean, unknown_labels bigint, "
            "unknown_label_examples array<string>")


def merge_moments(count_a: int, mean_a: np.ndarray, m2_a: np.ndarray,
                  count_b: int, mean_b: np.ndarray, m2_b: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """Chan et al.'s pairwise combination of (count, mean, sum of squared deviations)."""
    if count_b == 0:
        return count_a, mean_a, m2_a
    if count_a == 0:
        return count_b, mean_b, m2_b
    count = count_a + count_b
    delta = mean_b - mean_a
    mean = mean_a + delta * (count_b / count)
    m2 = m2_a + m2_b + delta * delta * (count_a * count_b / count)
    return count, mean, m2


def value_set(values: Sequence[str], numeric: bool) -> pa.Array:
    """The allowed values of a column as an Arrow array: float64 for a numeric column, text otherwise."""
    return pa.array([float(v) for v in values], pa.float64()) if numeric else pa.array(list(values), pa.string())


def outside(column: pa.Array, allowed: pa.Array) -> np.ndarray:
    """Booleans: the value is present but not in `allowed` (nulls are not flagged here)."""
    values = column if column.type == allowed.type else column.cast(allowed.type)
    found = pc.is_in(values, value_set=allowed)
    return ~pc.fill_null(pc.or_(found, pc.is_null(values)), True).to_numpy(zero_copy_only=False)


def invalid_flags(batch: pa.RecordBatch, float_columns: Sequence[str], other_columns: Sequence[str],
                  allowed: Mapping[str, pa.Array] | None = None) -> np.ndarray:
    """[rows, columns] booleans: null/NaN/inf in each float column, then null in each other column (or,
    for a column in `allowed`, a value outside its allowed set)."""
    flags = np.empty((batch.num_rows, len(float_columns) + len(other_columns)), dtype=bool)
    for i, name in enumerate(float_columns):
        column = batch.column(name)
        values = column.to_numpy(zero_copy_only=False)  # nulls come back as NaN
        flags[:, i] = ~np.isfinite(values)
        if column.null_count:
            flags[:, i] |= column.is_null().to_numpy(zero_copy_only=False)
    for j, name in enumerate(other_columns, start=len(float_columns)):
        column = batch.column(name)
        flags[:, j] = column.is_null().to_numpy(zero_copy_only=False) if column.null_count else False
        if allowed and name in allowed:
            flags[:, j] |= outside(column, allowed[name])
    return flags


def make_profile_fn(
    feature_columns: Sequence[str],
    label_column: str,
    split_column: str,
    float_columns: Sequence[str],
    other_checked_columns: Sequence[str],
    nonnum_column: str | None,
    num_nonnum: int,
    max_labels: int,
    collect_labels: bool,
    label_values: Sequence[str] | None = None,
    numeric_labels: bool = False,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Build the mapInArrow body. `nonnum_column` (when there are text columns) holds per-row flag arrays.

    label_values (the configured classes) makes a row whose label is not among them invalid; such rows
    are counted apart too, with a few example values. Numeric labels compare as numbers.
    """
    columns = list(feature_columns)
    width = len(columns)
    floats, others = list(float_columns), list(other_checked_columns)
    allowed = None if label_values is None else {label_column: value_set(label_values, numeric_labels)}

    def profile(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        rows = bad_rows = 0
        bad = np.zeros(len(floats) + len(others), dtype=np.int64)
        nonnum = np.zeros(num_nonnum, dtype=np.int64)
        split_rows = np.zeros(len(SPLITS), dtype=np.int64)
        count, mean, m2 = 0, np.zeros(width), np.zeros(width)
        labels: set[str] = set()
        unknown = 0
        unknown_examples: set[str] = set()
        for batch in batches:
            if batch.num_rows == 0:
                continue
            rows += batch.num_rows
            flags = invalid_flags(batch, floats, others, allowed)
            if allowed is not None:
                label_column_values = batch.column(label_column)
                mask = outside(label_column_values, allowed[label_column])
                if mask.any():
                    unknown += int(mask.sum())
                    if len(unknown_examples) < MAX_LABEL_EXAMPLES:
                        odd = pc.unique(label_column_values.filter(pa.array(mask))).to_pylist()
                        unknown_examples.update(str(v) for v in odd[:MAX_LABEL_EXAMPLES])
            bad += flags.sum(axis=0, dtype=np.int64)
            row_bad = flags.any(axis=1)
            if nonnum_column:
                text_flags = batch.column(nonnum_column).flatten().to_numpy(zero_copy_only=False)
                nonnum += text_flags.astype(bool).reshape(batch.num_rows, num_nonnum).sum(axis=0, dtype=np.int64)
            bad_rows += int(row_bad.sum())
            valid = ~row_bad
            splits = batch.column(split_column).to_numpy(zero_copy_only=False)
            for i, name in enumerate(SPLITS):
                split_rows[i] += int(((splits == name) & valid).sum())
            train = (splits == "train") & valid
            n_train = int(train.sum())
            if n_train and width:
                matrix = np.empty((n_train, width))
                for j, c in enumerate(columns):
                    matrix[:, j] = batch.column(c).to_numpy(zero_copy_only=False)[train]
                batch_mean = matrix.mean(axis=0)
                matrix -= batch_mean
                batch_m2 = np.einsum("ij,ij->j", matrix, matrix)
                count, mean, m2 = merge_moments(count, mean, m2, n_train, batch_mean, batch_m2)
            if collect_labels and len(labels) <= max_labels:
                label_values = batch.column(label_column).filter(pa.array(valid))
                labels.update(str(v) for v in pc.unique(label_values).to_pylist())
        truncated = len(labels) > max_labels
        yield pa.RecordBatch.from_pylist([{
            "pid": TaskContext.get().partitionId(), "rows": rows, "bad_rows": bad_rows, "bad": bad.tolist(),
            "nonnum": nonnum.tolist(), "split_rows": split_rows.tolist(), "train_count": count,
            "train_mean": mean.tolist(), "train_m2": m2.tolist(),
            "labels": sorted(labels)[:max_labels + 1], "labels_truncated": truncated,
            "unknown_labels": unknown, "unknown_label_examples": sorted(unknown_examples)[:MAX_LABEL_EXAMPLES],
        }], schema=_schema())

    return profile


def _schema() -> pa.Schema:
    longs = pa.list_(pa.int64())
    doubles = pa.list_(pa.float64())
    return pa.schema([("pid", pa.int32()), ("rows", pa.int64()), ("bad_rows", pa.int64()), ("bad", longs),
                      ("nonnum", longs), ("split_rows", longs), ("train_count", pa.int64()),
                      ("train_mean", doubles), ("train_m2", doubles), ("labels", pa.list_(pa.string())),
                      ("labels_truncated", pa.bool_()), ("unknown_labels", pa.int64()),
                      ("unknown_label_examples", pa.list_(pa.string()))])
