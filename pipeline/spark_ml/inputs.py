"""What the Spark ML stages read: the estimator's Parquet copy of its input frame (and the data.features
items it holds), and the column ShardlineModel.transform feeds its scoring UDF.

Two input forms: the classic single featuresCol (a Vector or numeric array, expanded to numeric features
f0..fN-1), or inputCols, raw typed columns, one feature each, preprocessed by the ETL (and at transform
time by udfs.transforms.Transform) exactly as a `data.features` source would be.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

from pipeline.config.feature_spec import FeatureSet
from pipeline.config.schema import PipelineConfig
from pipeline.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ROW_ID = "row_id"
LABEL = "label"


def feature_name(i: int) -> str:
    return f"f{i}"


def _col(name: str):
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def input_copy(dataset, inputs: list[str], features_col: str, label_col: str, cfg: PipelineConfig,
               target: Path) -> list:
    """Write the features (f0..fN-1 from `features_col`, or the `inputs` columns), the label and a row id
    (fixed once, here) as the Parquet source at `target`; return the data.features items it holds."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, NumericType

    columns = inputs or [features_col]
    for column in columns + [label_col]:
        if column not in dataset.columns:
            raise DataError(f"column {column!r} is not in the input DataFrame (columns: {dataset.columns})")
    if label_col in inputs or set(inputs) & {LABEL, ROW_ID}:
        raise DataError(f"inputCols {inputs} may not hold the label column {label_col!r} or the names "
                        f"{LABEL!r}/{ROW_ID!r} the input copy uses")
    arrays = {}
    for column in columns:
        ftype = dataset.schema[column].dataType
        if isinstance(ftype, VectorUDT):
            arrays[column] = vector_to_array(_col(column), "float64")
        elif isinstance(ftype, ArrayType) and isinstance(ftype.elementType, NumericType):
            arrays[column] = _col(column).cast("array<double>")
        elif not inputs:
            raise DataError(f"featuresCol {column!r} has type {ftype.simpleString()}; it must be a Vector "
                            "(e.g. from VectorAssembler) or an array of numbers")
    label = _col(label_col)
    integral_labels = cfg.data.task == "classification" and \
        dataset.schema[label_col].dataType.typeName() in ("double", "float")
    fractional = (label != F.floor(label)) if integral_labels else F.lit(False)
    first = dataset.select(F.count(F.lit(1)).alias("rows"), F.count(F.when(fractional, 1)).alias("fractional"),
                           *[F.max(F.size(a)).alias(f"n{i}") for i, a in enumerate(arrays.values())]).first()
    lengths = {c: first[f"n{i}"] for i, c in enumerate(arrays)}
    if not first["rows"] or any(n is None or n < 1 for n in lengths.values()):
        raise DataError("the input DataFrame has no rows with features")
    if first["fractional"]:
        raise DataError(f"label column {label_col!r} has {first['fractional']} non-integer values for a "
                        "classification task; set overrides=['data.task=regression']")
    if integral_labels:  # Spark ML labels are doubles: 3.0 becomes the int64 class "3"
        label = label.cast("long")
    if inputs:
        features = typed_features(dataset, inputs, lengths, cfg)
        selected = [arrays[c].alias(c) if c in arrays else _col(c) for c in inputs]
    else:
        n = int(lengths[features_col])
        features = [feature_name(i) for i in range(n)]
        selected = [arrays[features_col][i].alias(feature_name(i)) for i in range(n)]
    frame = dataset.select(F.monotonically_increasing_id().alias(ROW_ID), *selected, label.alias(LABEL))
    if target.exists():
        shutil.rmtree(target)
    frame.write.parquet(str(target))
    return features


def typed_features(dataset, inputs: list[str], lengths: dict[str, int], cfg: PipelineConfig) -> list:
    """data.features items for inputCols: a configured entry (data.features, by name) as it is, else by
    the column's type: a number is numeric, a string categorical, a Vector/array a vector of its length."""
    from pyspark.sql.types import NumericType, StringType

    configured = {(f if isinstance(f, str) else f.name): f for f in (cfg.data.features or [])}
    unknown = sorted(set(configured) - set(inputs))
    if unknown:
        raise ConfigError(f"data.features names {unknown}, which are not in inputCols {inputs}")
    items = []
    for column in inputs:
        entry = configured.get(column)
        dtype = dataset.schema[column].dataType
        if entry is not None:
            items.append(entry if isinstance(entry, str) else entry.model_dump(mode="json"))
        elif column in lengths:
            items.append({"name": column, "type": "vector", "length": int(lengths[column])})
        elif isinstance(dtype, NumericType):
            items.append(column)
        elif isinstance(dtype, StringType):
            items.append({"name": column, "type": "categorical"})
        else:
            raise ConfigError(f"input column {column!r} has type {dtype.simpleString()}: give it a typed entry, "
                              f"e.g. overrides=['data.features=[{{name: {column}, type: image, height: 32, "
                              "width: 32}]'] (types: numeric, categorical, vector, image, text)")
    return items


def transform_input(dataset, features: Optional[list], features_col: str, means: list, stds: list):
    """(the Spark column the scoring UDF takes, the FeatureSpec dicts it applies, the classic numeric names
    or None): a struct of each feature's raw column (inputCols models), or the features vector as
    array<double> whose entries are the numeric features f0..fN-1 standardized with means/stds."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    from udfs.score import spark_input

    if features is not None:
        missing = [s["name"] for s in features if s["name"] not in dataset.columns]
        if missing:
            raise DataError(f"input column(s) {missing} are not in the DataFrame (columns: {dataset.columns})")
        columns = []
        for spec in features:
            column, needs = spark_input(dataset, spec)
            if column is None:
                raise DataError(f"input column {spec['name']!r} has type "
                                f"{dataset.schema[spec['name']].dataType.simpleString()}; the {spec['type']} "
                                f"feature needs {needs}")
            columns.append(column.alias(spec["name"]))
        return F.struct(*columns), features, None
    if features_col not in dataset.columns:
        raise DataError(f"column {features_col!r} is not in the DataFrame (columns: {dataset.columns})")
    ftype = dataset.schema[features_col].dataType
    column = vector_to_array(_col(features_col), "float64") if isinstance(ftype, VectorUDT) \
        else _col(features_col).cast("array<double>")
    names = [feature_name(i) for i in range(len(means))]
    return column, FeatureSet.numeric_only(names, means, stds, standardize=True).to_list(), names
