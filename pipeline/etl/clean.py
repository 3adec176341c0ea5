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
    # Per column: null, NaN or infinite values (including the non-numeric ones), and for the label column
    # values outside data.classes.
    invalid_by_column: dict[str, int] = field(default_factory=dict)
    # Rows whose label is not in data.classes (also counted in invalid_by_column[label]), with examples.
    labels_not_in_classes: int = 0
    label_examples_not_in_classes: list[str] = field(default_factory=list)


def describe_input(data: DataConfig) -> str:
    """Where the rows came from, for error messages: the path and the key that sets it."""
    if data.source == "delta" and data.version is not None:
        return f"Delta table {data.path} at version {data.version} (data.path, data.version)"
    if data.source == "iceberg" and data.snapshot_id is not None:
        return f"Iceberg table {data.path} at snapshot {data.snapshot_id} (data.path, data.snapshot_id)"
    return f"data.path={data.path}" if data.path else f"the built-in {data.source} data"


def feature_columns(columns: list[str], data: DataConfig, id_column: Optional[str]) -> list[str]:
    where = describe_input(data)
    if not columns:
        raise DataError(f"the input ({where}) has no columns: the file is empty or has no header; "
                        "point data.path at data with a header row (or set data.csv_options)")
    if data.features is not None:
        missing = [c for c in data.feature_names if c not in columns]
        if missing:
            raise DataError(f"feature column(s) {missing} named in data.features are not in the input ({where}; "
                            f"columns present: {columns}); fix data.features, or null it to use every column")
    if data.label not in columns:
        raise DataError(f"label column {data.label!r} (data.label) is not in the input ({where}; columns present: "
                        f"{columns}); set data.label to the label column")
    if data.features is not None:
        return list(data.feature_names)
    excluded = {data.label, id_column}
    features = [c for c in columns if c not in excluded]
    if not features:
        raise DataError(f"no feature columns left in {where} after removing the label {data.label!r}"
                        f"{' and the id column ' + repr(id_column) if id_column else ''}; set data.features")
    return features


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


NONNUM_FLAGS = "__nonnum"


@dataclass(frozen=True)
class CastFrame:
    """The source with every feature (and a regression label) as a float column, ready for the Arrow UDFs.

    Float columns pass through untouched (float32 stays float32 on the wire); other numbers are cast to
    double; text is try_cast to double, and one flag array column (only when there is text) marks the
    values that were present but not numbers. Null/NaN/inf checks happen vectorized in the UDFs, which
    keeps the Spark plan flat and small on wide tables.
    """
    df: object
    cast_columns: list[str]      # the float columns the UDFs check for null/NaN/inf
    checked_columns: list[str]   # cast_columns, plus a classification label (checked for null only)
    text_columns: list[str]      # the cast columns that were text: counted in NONNUM_FLAGS


def cast_with_flags(df, features: list[str], data: DataConfig) -> CastFrame:
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType, FloatType, NumericType

    label_col = data.label
    cast_cols = features + ([label_col] if data.task == "regression" else [])
    checks = cast_cols if data.task == "regression" else cast_cols + [label_col]
    types = {f.name: f.dataType for f in df.schema.fields}
    text = [c for c in cast_cols if not isinstance(types[c], NumericType)]

    def as_float(c):
        if isinstance(types[c], (FloatType, DoubleType)):
            return F.col(c)
        if c in text:
            return F.expr(f"try_cast({_q(c)} AS DOUBLE)").alias(c)
        return F.col(c).cast("double").alias(c)

    columns = [F.col(c) for c in df.columns if c not in cast_cols] + [as_float(c) for c in cast_cols]
    if text:
        columns.append(F.array(*[(F.col(c).isNotNull() & F.expr(f"try_cast({_q(c)} AS DOUBLE)").isNull())
                                 for c in text]).alias(NONNUM_FLAGS))
    return CastFrame(df.select(*columns), cast_cols, checks, text)


def clean_report(frame: CastFrame, data: DataConfig, rows: int, bad_rows: int,
                 bad_by_column: list[int], nonnum_by_column: list[int], unknown_labels: int = 0,
                 unknown_label_examples: Optional[list[str]] = None) -> CleanReport:
    """Judge the profiled counts: a clear error for empty, all-invalid or (with reject) any invalid input."""
    report = CleanReport(input_rows=rows, invalid_rows=bad_rows, output_rows=rows - bad_rows,
                         labels_not_in_classes=unknown_labels,
                         label_examples_not_in_classes=list(unknown_label_examples or []))
    report.invalid_by_column = {c: n for c, n in zip(frame.checked_columns, bad_by_column) if n}
    report.non_numeric = {c: n for c, n in zip(frame.text_columns, nonnum_by_column) if n}
    where = describe_input(data)
    if report.input_rows == 0:
        raise DataError(f"the input ({where}, data.source={data.source}) has no rows; "
                        "point data.path at a file or folder that holds data")
    unknown = ""
    if unknown_labels:
        unknown = (f"; {unknown_labels} label(s) in column {data.label!r} are not in data.classes {data.classes}, "
                   f"e.g. {report.label_examples_not_in_classes}")
    what = "null/NaN/inf or non-numeric values" + (" or a label outside data.classes" if data.classes else "")
    if report.invalid_rows and data.invalid_rows == "reject":
        fix = "fix the input" + (", add the missing labels to data.classes" if unknown_labels else "")
        raise DataError(
            f"{report.invalid_rows} of {report.input_rows} rows in {where} have {what} "
            f"(by column: {report.invalid_by_column}; non-numeric: {report.non_numeric or 'none'}{unknown}); "
            f"{fix} or set data.invalid_rows=drop to drop them")
    if report.output_rows == 0:
        raise DataError(f"all {report.input_rows} input rows in {where} are invalid: {what} "
                        f"(by column: {report.invalid_by_column}; non-numeric: {report.non_numeric or 'none'}"
                        f"{unknown}); fix the input, data.features/data.label or data.classes")
    if report.invalid_rows:
        log.warning("dropped %d of %d rows with %s (by column: %s; non-numeric: %s%s)", report.invalid_rows,
                    report.input_rows, what, report.invalid_by_column, report.non_numeric or "none", unknown)
    return report


def configured_classes(classes: list[str], label_col: str, label_type: str, numeric: bool) -> list[str]:
    """data.classes as the values the label column holds: text as given, or integers for a numeric label."""
    if not numeric:
        return list(classes)
    normalized = []
    for value in classes:
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not number.is_integer():
            raise DataError(f"data.classes lists {value!r}, but label column {label_col!r} is numeric ({label_type}); "
                            "list the classes as integers (e.g. data.classes=[0, 1, 2])")
        normalized.append(str(int(number)))
    repeated = sorted({v for v in normalized if normalized.count(v) > 1})
    if repeated:
        raise DataError(f"data.classes lists the label value(s) {repeated} more than once (as numbers, for the "
                        f"numeric label column {label_col!r}); list each class once")
    return normalized


def label_mapping(values: list[str], truncated: bool, label_col: str, numeric: bool) -> list[str]:
    """Sorted distinct labels (as strings; numeric labels sorted numerically) from the profiled values."""
    if truncated or len(values) > MAX_CLASSES:
        raise DataError(f"label column {label_col!r} has more than {MAX_CLASSES} distinct values; "
                        "for a numeric target set data.task=regression")
    if numeric:
        fractional = [v for v in values if float(v) != int(float(v))]
        if fractional:
            raise DataError(f"label column {label_col!r} has non-integer values such as {fractional[:3]} "
                            "for a classification task; set data.task=regression")
        return [str(v) for v in sorted({int(float(v)) for v in values})]
    return sorted(values)
