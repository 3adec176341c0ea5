"""The ETL of typed features: check and cast the source columns, profile, fit on the train split, pack.

A fit reads the source once (pipeline/etl/onepass.py, issue 15): pass 1 profiles every row (counts,
split sizes, numeric moments, labels) and writes the valid rows to scratch Arrow files with each learned
categorical as a partition-local int32 id, beside each partition's local dictionary with train counts;
the driver sums the counts and ranks the vocabularies (pipeline/etl/vocab.py); pass 2 reads the scratch
files (ids and numbers, no strings), maps local -> global ids and writes the shards. Medians by Spark
ML's `Imputer`, means and deviations from the profile's moments (Chan's merge). A frozen fit (a later
workflow partition) needs no counts: a profile pass without them and the pack (udfs/typed_pack.py)
with the frozen vocabularies, as before. No path shuffles rows.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict

import pyarrow as pa

from pipeline.config.feature_spec import FeatureSet
from pipeline.config.features import as_entries
from pipeline.config.schema import PipelineConfig
from pipeline.config.workdir import Workdir
from pipeline.etl.checks import check_split_sizes, input_errors
from pipeline.etl.clean import label_mapping
from pipeline.etl.direct_read import direct_source
from pipeline.etl.fit import fit_features, merge_profiles, profile_report
from pipeline.etl.onepass import encode_pass, scratch_base, scratch_folder
from pipeline.etl.split import SPLIT_COLUMN, assign_split
from pipeline.errors import ConfigError, DataError
from pipeline.shards.manifest import Manifest

log = logging.getLogger(__name__)


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _type_error(entry, dtype, needs: str) -> DataError:
    return DataError(f"feature column {entry.name!r} has type {dtype.simpleString()}, but data.features declares it "
                     f"type: {entry.type}, which needs {needs}; fix the column's type or the feature's type")


def cast_columns(df, entries, data):
    """The selected source with each feature column in the form the UDFs read, after a type check."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import (ArrayType, BinaryType, BooleanType, IntegralType, NumericType, StringType)

    types = {f.name: f.dataType for f in df.schema.fields}
    exprs, source_types = {}, {}
    for entry in entries:
        dtype, col = types[entry.name], F.col(_q(entry.name))
        source_types[entry.name] = dtype.simpleString()
        if entry.type == "numeric":
            if isinstance(dtype, (NumericType, BooleanType)):
                exprs[entry.name] = col.cast("double")
            elif isinstance(dtype, StringType):
                exprs[entry.name] = F.expr(f"try_cast({_q(entry.name)} AS DOUBLE)")
            else:
                raise _type_error(entry, dtype, "a number (or text holding numbers); for arrays use type: vector")
        elif entry.type == "categorical":
            if isinstance(dtype, (StringType, IntegralType, BooleanType)):
                exprs[entry.name] = col.cast("string") if isinstance(dtype, BooleanType) else col
            elif isinstance(dtype, NumericType):
                exprs[entry.name] = col.cast("double")
            else:
                raise _type_error(entry, dtype, "a string or integer column")
        elif entry.type == "vector":
            if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, NumericType):
                exprs[entry.name] = col.cast("array<double>")
            elif type(dtype).__name__ == "VectorUDT":
                from pyspark.ml.functions import vector_to_array

                exprs[entry.name] = vector_to_array(col, "float64")
            else:
                raise _type_error(entry, dtype, "an array of numbers or a Spark ML Vector")
        elif entry.type == "image":
            wanted = BinaryType if entry.source == "bytes" else StringType
            if not isinstance(dtype, wanted):
                raise _type_error(entry, dtype, "binary image bytes (image.source: bytes)" if entry.source == "bytes"
                                  else "a string of file paths (image.source: path)")
            exprs[entry.name] = col
        elif entry.type == "text":
            if isinstance(dtype, StringType):
                exprs[entry.name] = col
            elif isinstance(dtype, ArrayType) and isinstance(dtype.elementType, (IntegralType, StringType)):
                exprs[entry.name] = col
            else:
                raise _type_error(entry, dtype, "a string, or an array of integer (or string) tokens")
    label_type = types[data.label]
    if data.task == "regression":
        label = F.expr(f"try_cast({_q(data.label)} AS DOUBLE)") if isinstance(label_type, StringType) \
            else F.col(_q(data.label)).cast("double")
    else:
        label = F.col(_q(data.label))
    others = [F.col(_q(c)) for c in df.columns if c not in exprs and c != data.label]
    return df.select(*others, *[e.alias(name) for name, e in exprs.items()], label.alias(data.label)), source_types


def row_bytes(features: FeatureSet) -> int:
    """Estimated stored bytes of one shard row (sizes a shard file)."""
    total = 16 + 4 * features.numeric_width
    for f in features:
        total += {"categorical": 8, "vector": 4 * f.length, "text": 8 * f.max_len + 8,
                  "image": f.channels * f.height * f.width // (4 if f.storage == "encoded" else 1)}.get(f.type, 0)
    return total


def run_typed_etl(spark, cfg: PipelineConfig, selected, id_column, classes, numeric_labels: bool, statistics,
                  started: float, origin: dict) -> Manifest:
    """The ETL of typed data.features; `origin`: where the rows came from, for the manifest."""
    from udfs.profile import value_set

    data = cfg.data
    if statistics is not None and not isinstance(statistics, Manifest):
        raise ConfigError("frozen statistics for typed data.features are the shard set that fitted them (a "
                          "Manifest), not numeric means/stds")
    entries = as_entries(list(data.features))
    if statistics is not None and [f.name for f in statistics.feature_set] != [e.name for e in entries]:
        raise DataError(f"the frozen fit of {statistics.root} covers features {[f.name for f in statistics.feature_set]}, "
                        f"this input declares {[e.name for e in entries]}; the source's columns changed: start a "
                        "new workflow state")
    cast, source_types = cast_columns(selected, entries, data)
    names = [e.name for e in entries]
    df = assign_split(cast, [id_column] if id_column else names + [data.label], data.split)
    allowed = None if classes is None else {data.label: value_set(classes, numeric_labels)}
    if statistics is not None:  # the incremental workflow's later partitions: preprocessed exactly as the first
        with input_errors(data):
            profiles = merge_profiles(spark, df, entries, data, allowed, source_types)
            report = profile_report(profiles, data, entries)
        specs = list(statistics.feature_set)
        vocabularies = {f.vocabulary: statistics.vocabulary(f.name).to_pylist() for f in specs if f.vocabulary}
        return _pack_and_write(spark, cfg, df, None, profiles, report, specs, vocabularies, classes, numeric_labels,
                               allowed, started, origin)
    with scratch_folder(scratch_base(spark, Workdir.of(cfg).shards)) as scratch:
        with input_errors(data):
            direct = direct_source(selected, cast, names + [data.label], id_column, data.split)
            profiles, files = encode_pass(df, entries, data, allowed, source_types, scratch, direct)
            report = profile_report(profiles, data, entries)
            specs, vocabularies = fit_features(spark, df, profiles, entries, data, source_types)
        return _pack_and_write(spark, cfg, df, files, profiles, report, specs, vocabularies, classes, numeric_labels,
                               allowed, started, origin)


def _pack_and_write(spark, cfg: PipelineConfig, df, files, profiles, report, specs, vocabularies, classes,
                    numeric_labels: bool, allowed, started: float, origin: dict) -> Manifest:
    """The shards written: by the two-pass pack over `df` (files None: a frozen fit), or by the one-pass
    remap over pass 1's `files`."""
    from udfs.typed_pack import make_typed_pack_fn
    from udfs.typed_remap import make_remap_fn

    from pipeline.shards.write import write_shards

    data = cfg.data
    regression = data.task == "regression"
    log.info("profile + fit: %d rows, %d features in %.1fs", report.input_rows, len(specs), time.perf_counter() - started)
    totals = profiles.totals
    labels = None
    if data.task == "classification":
        labels = classes if classes is not None else label_mapping(
            profiles.labels, profiles.labels_truncated, data.label, numeric_labels)
    num_shards = check_split_sizes(totals, report, data, cfg.parallelism.data, cfg.train.batch_size)
    features = FeatureSet(tuple(specs))
    spec_dicts = [s.to_dict() for s in specs]
    vocab_arrays = {s.name: pa.array(vocabularies[s.vocabulary], pa.string()) for s in specs if s.vocabulary}
    if files is None:
        pack = make_typed_pack_fn(spec_dicts, vocab_arrays, data.label, SPLIT_COLUMN, labels, numeric_labels,
                                  regression, allowed, profiles.offsets, profiles.split_rows, num_shards)
        source = df
    else:
        pack = make_remap_fn(spec_dicts, vocab_arrays, files, data.label, SPLIT_COLUMN, labels, numeric_labels,
                             profiles.offsets, profiles.split_rows, num_shards)
        partitions = max(files, default=-1) + 1
        source = spark.range(0, partitions, 1, max(1, partitions))
    numeric = features.numeric
    means = [v for f in numeric for v in ([f.mean, 0.0] if f.missing_flag else [f.mean])]
    stds = [v for f in numeric for v in ([f.std, 1.0] if f.missing_flag else [f.std])]
    etl_report = {**asdict(report), "split_rows": totals, **origin,
                  "features": {f.name: f.type for f in features}}
    with input_errors(data):
        manifest = write_shards(
            source, pack, Workdir.of(cfg).shards, num_shards=num_shards, name=cfg.name, task=data.task,
            feature_columns=features.numeric_columns, label_column=data.label,
            label_mapping=list(classes) if classes is not None else labels,
            standardized=any(f.standardize for f in numeric), means=means, stds=stds, etl_report=etl_report,
            rows_per_row_group=cfg.shards.rows_per_row_group,
            rows_per_file=max(1, int(cfg.shards.target_file_mb * 2**20 / row_bytes(features))),
            features=spec_dicts, vocabularies=vocabularies)
    for split, info in manifest.splits.items():
        if info.rows != totals[split]:
            raise DataError(f"internal: wrote {info.rows} {split} rows but profiled {totals[split]}; please report this")
    log.info("etl done in %.1fs: %d input rows, %d invalid (%s), splits %s, features %s",
             time.perf_counter() - started, report.input_rows, report.invalid_rows, data.invalid_rows, totals,
             {f.name: f.type for f in features})
    return manifest

