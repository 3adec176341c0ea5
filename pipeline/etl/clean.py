"""Column selection, casting, invalid-row handling and label indexing, with every count reported."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from pipeline.config.schema import DataConfig
from pipeline.errors import DataError

log = logging.getLogger(__name__)

MAX_CLASSES = 10_000


@dataclass
class CleanReport:
    input_rows: int = 0
    output_rows: int = 0
    invalid_rows: int = 0
    # Per column: values present in the input that are not numbers (after a cast attempt).
    non_numeric: dict[str, int] = field(default_factory=dict)
    # Per column: null, NaN or infinite values (including the non-numeric ones).
    invalid_by_column: dict[str, int] = field(default_factory=dict)


def feature_columns(columns: list[str], data: DataConfig, id_column: Optional[str]) -> list[str]:
    if data.features is not None:
        missing = [c for c in data.features + [data.label] if c not in columns]
        if missing:
            raise DataError(f"column(s) {missing} named in data.features/data.label are not in the input "
                            f"(columns present: {columns}); fix data.features or data.label")
        return list(data.features)
    if data.label not in columns:
        raise DataError(f"label column {data.label!r} (data.label) is not in the input; columns present: {columns}")
    excluded = {data.label, id_column}
    features = [c for c in columns if c not in excluded]
    if not features:
        raise DataError(f"no feature columns left after removing the label {data.label!r}; set data.features")
    return features


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def cast_and_filter(df, features: list[str], data: DataConfig):
    """Cast features (and a regression label) to double; count and drop or reject invalid rows."""
    from pyspark.sql import functions as F

    label_col = data.label
    cast_cols = features + ([label_col] if data.task == "regression" else [])
    checks = cast_cols if data.task == "regression" else cast_cols + [label_col]

    def invalid(c):
        if c not in cast_cols:  # an untouched classification label: only null is invalid
            return F.col(c).isNull()
        return F.col(c).isNull() | F.isnan(F.col(c)) | (F.abs(F.col(c)) == float("inf"))

    # Per-row flags live in two flat array columns: a wide table then gives a flat plan instead of a
    # chain of hundreds of nested ORs, which Spark's optimizer handles very slowly.
    casted = df.select(
        *[F.col(c) for c in df.columns if c not in cast_cols],
        *[F.expr(f"try_cast({_q(c)} AS DOUBLE)").alias(c) for c in cast_cols],
        F.array(*[(F.col(c).isNotNull() & F.expr(f"try_cast({_q(c)} AS DOUBLE)").isNull())
                  for c in cast_cols]).alias("__nonnum"),
    ).withColumn("__bad", F.array(*[invalid(c) for c in checks]))
    any_invalid = F.array_contains(F.col("__bad"), True)
    aggs = [F.count(F.lit(1)).alias("__rows"), F.sum(any_invalid.cast("long")).alias("__bad_rows")]
    aggs += [F.sum(F.col("__bad")[i].cast("long")).alias(f"__bad_{i}") for i in range(len(checks))]
    aggs += [F.sum(F.col("__nonnum")[i].cast("long")).alias(f"__nonnum_{i}") for i in range(len(cast_cols))]
    row = casted.agg(*aggs).collect()[0]
    report = CleanReport(input_rows=row["__rows"] or 0, invalid_rows=row["__bad_rows"] or 0)
    report.invalid_by_column = {c: row[f"__bad_{i}"] for i, c in enumerate(checks) if row[f"__bad_{i}"]}
    report.non_numeric = {c: row[f"__nonnum_{i}"] for i, c in enumerate(cast_cols) if row[f"__nonnum_{i}"]}
    if report.input_rows == 0:
        raise DataError(f"the input of data.source={data.source} ({data.path or 'built-in'}) has no rows")
    if report.invalid_rows and data.invalid_rows == "reject":
        raise DataError(
            f"{report.invalid_rows} of {report.input_rows} rows have null/NaN/inf or non-numeric values "
            f"(by column: {report.invalid_by_column}; non-numeric: {report.non_numeric or 'none'}); "
            "fix the input or set data.invalid_rows=drop")
    cleaned = casted.where(~any_invalid).drop("__bad", "__nonnum")
    report.output_rows = report.input_rows - report.invalid_rows
    if report.output_rows == 0:
        raise DataError(f"all {report.input_rows} input rows are invalid (by column: {report.invalid_by_column})")
    if report.invalid_rows:
        log.warning("dropped %d of %d rows with null/NaN/inf or non-numeric values (by column: %s)",
                    report.invalid_rows, report.input_rows, report.invalid_by_column)
    return cleaned, report


def label_mapping(df, label_col: str) -> tuple[list[str], bool]:
    """Sorted distinct labels (as strings) and whether they are numeric (sorted numerically then)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import NumericType

    numeric = isinstance(df.schema[label_col].dataType, NumericType)
    values = [r[0] for r in df.select(F.col(label_col)).distinct().limit(MAX_CLASSES + 1).collect()]
    if len(values) > MAX_CLASSES:
        raise DataError(f"label column {label_col!r} has more than {MAX_CLASSES} distinct values; "
                        "for a numeric target set data.task=regression")
    if numeric:
        fractional = [v for v in values if float(v) != int(float(v))]
        if fractional:
            raise DataError(f"label column {label_col!r} has non-integer values such as {fractional[:3]} "
                            "for a classification task; set data.task=regression")
        return [str(v) for v in sorted(int(float(v)) for v in values)], True
    return sorted(str(v) for v in values), False


def index_labels(df, label_col: str, labels: list[str], numeric: bool):
    """Replace the label column by its class index (bigint), via the vectorized UDF in udfs/."""
    from pyspark.sql import functions as F

    from udfs.labels import make_label_indexer

    as_text = F.col(label_col).cast("bigint").cast("string") if numeric else F.col(label_col).cast("string")
    indexer = make_label_indexer({label: i for i, label in enumerate(labels)})
    return df.withColumn(label_col, indexer(as_text))
