"""Batch scoring with a tracked model: `shardline score --model models:/NAME@champion --input ... --output ...`.

The model URI is resolved through the registry to its training run, whose artifacts hold everything needed:
`shardline/model.pt` (the ModelSpec + flat fp32 state: parameters and buffers), `data/manifest.json` (the
fitted features: FeatureSpecs with the train-split statistics, and the label mapping) and `data/vocab/<feature>.parquet`
(the vocabularies of categorical/text features). The input (a Parquet path or a table name, any size) is
read by Spark and the RAW source column of each feature selected: numbers cast to double (text
try_cast), categoricals as string/integer, images as binary (or path strings), vectors and Spark ML
Vectors as array<double>, text as strings or token arrays; a column of another type is a DataError
naming it. One Arrow UDF (udfs/score.py) per partition applies udfs.transforms.Transform, the ETL's own
preprocessing, runs batched inference with a model built once per Python worker, and maps class indices
back to the original label values. Predictions are written as Parquet to a hidden staging folder next to
the output and renamed into place, so a reader never sees a half-written output. With score.output_format
delta or iceberg the predictions, with the model's URI and registered version as columns, are appended to a
table in one commit instead (pipeline/score/output.py: where the predictions go).

Invalid rows (what the Transform refuses: a missing numeric value that is not imputed, a vector of
another length, bytes that are not an image) follow `score.invalid_rows`: drop (left out, counted per
column), reject (a pre-pass counts them and fails before anything is written), keep_null (written with
null predictions, counted). They are never scored.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pipeline.config.schema import PipelineConfig
from pipeline.errors import DataError, ShardlineError
from pipeline.models import model_from_flat
from pipeline.score.output import MODEL_COLUMNS, check_output, table_target, write_parquet_output
from pipeline.shards import MANIFEST_NAME, Manifest, load_manifest

log = logging.getLogger(__name__)

MODEL_ARTIFACT = "shardline/model.pt"  # written by pipeline.steps._train_into (MODEL_ARTIFACT_DIR)
MANIFEST_ARTIFACT = f"data/{MANIFEST_NAME}"
VOCAB_ARTIFACT = "data/vocab/{}.parquet"  # written by TrackedRun.log_manifest / log_vocabularies


@dataclass
class ScoreResult:
    model_uri: str
    run_id: str
    output: str
    input_rows: int
    scored_rows: int
    invalid_rows: int
    invalid_by_column: dict[str, int]
    written_rows: int
    seconds: float
    rows_per_s: float
    mlflow_run_id: Optional[str] = None
    columns: list[str] = field(default_factory=list)
    table_version: Optional[int] = None  # a table output's commit: the Delta version or Iceberg snapshot id


@dataclass
class ScoringModel:
    """What the UDF needs, as plain values: spec dict, parameter bytes, the manifest's preprocessing and
    the vocabularies (feature name -> Arrow string array)."""
    spec: dict[str, Any]
    parameters: bytes
    manifest: Manifest
    run_id: str
    version: str = ""
    vocabularies: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        h = hashlib.sha256(json.dumps(self.spec, sort_keys=True, default=str).encode())
        h.update(self.parameters)
        return h.hexdigest()


def _tracking_uri(cfg: PipelineConfig) -> str:
    from pipeline.tracking import tracking_uri_of

    return tracking_uri_of(cfg)


def load_scoring_model(cfg: PipelineConfig, model_uri: str) -> ScoringModel:
    """Resolve `model_uri` to its training run and load model.pt, the manifest and its vocabularies."""
    import pyarrow.parquet as pq
    import torch

    from pipeline.models import ModelSpec
    from pipeline.tracking.registry import download, resolve_model

    uri = _tracking_uri(cfg)
    version = resolve_model(uri, model_uri)
    with tempfile.TemporaryDirectory(prefix="shardline-score-") as tmp:
        try:
            model_path = download(uri, version.run_id, MODEL_ARTIFACT, os.path.join(tmp, "model"))
            manifest_path = download(uri, version.run_id, MANIFEST_ARTIFACT, os.path.join(tmp, "data"))
        except Exception as exc:  # mlflow raises its own types; say which artifact is missing
            raise ShardlineError(f"{model_uri} (run {version.run_id}) lacks the artifacts shardline scores with "
                                 f"({MODEL_ARTIFACT}, {MANIFEST_ARTIFACT}): {exc}; was it trained by shardline?") \
                from None
        from pipeline.models.trust import allowed_factories, open_model

        # Before anything is built: the artifact may name only factories this config allows, and its state
        # must match the digest written with it.
        state = open_model(torch.load(model_path, weights_only=True), allowed_factories(cfg.model),
                           f"{model_uri} (run {version.run_id}) {MODEL_ARTIFACT}")
        manifest = _manifest_without_files(Path(manifest_path).parent)
        vocabularies = {}
        for feature in manifest.feature_set:
            if not feature.vocabulary or feature.hash_buckets:
                continue
            artifact = VOCAB_ARTIFACT.format(feature.name)
            try:
                path = download(uri, version.run_id, artifact, os.path.join(tmp, "vocab", feature.name))
            except Exception as exc:
                raise ShardlineError(f"{model_uri} (run {version.run_id}) lacks {artifact}, the vocabulary of "
                                     f"feature {feature.name!r} ({exc}); log it with TrackedRun.log_manifest") \
                    from None
            vocabularies[feature.name] = pq.read_table(path, columns=["value"]).column("value").combine_chunks()
    spec = ModelSpec.from_dict(state["spec"])
    parameters = state["parameters"].detach().cpu().to(torch.float32).contiguous().numpy().tobytes()
    features = manifest.feature_set
    if spec.num_features != features.numeric_width:
        raise ShardlineError(f"{model_uri}: the model takes {spec.num_features} numeric inputs but its manifest's "
                             f"features make {features.numeric_width}; the run's artifacts are inconsistent")
    if spec.features and [f["name"] for f in spec.features] != [f.name for f in features]:
        raise ShardlineError(f"{model_uri}: the model was built for features {[f['name'] for f in spec.features]}, "
                             f"its manifest lists {[f.name for f in features]}; the run's artifacts are inconsistent")
    return ScoringModel(spec.to_dict(), parameters, manifest, version.run_id, version.version, vocabularies)


def _manifest_without_files(folder: Path) -> Manifest:
    """The manifest from a downloaded artifact: its shard files are not here, only its metadata matters."""
    from pipeline.errors import ManifestError

    try:
        return load_manifest(folder)
    except ManifestError as exc:
        if "are missing" not in str(exc):
            raise
    data = json.loads((folder / MANIFEST_NAME).read_text())
    data["splits"] = {}  # the shard files live with the training run's shard set, not needed to score
    (folder / MANIFEST_NAME).write_text(json.dumps(data))
    return load_manifest(folder)


def _read_input(spark, source: str):
    """A Parquet path (anything with a path separator, a scheme or that exists) or a table name."""
    if "://" in source or os.sep in source or source.endswith(".parquet") or os.path.exists(source):
        if "://" not in source and not os.path.exists(source):
            raise DataError(f"score input {source} does not exist")
        from pipeline.storage.spark_io import read_parquet

        return read_parquet(spark, source)  # object-store URLs through pyarrow, the rest through Spark
    return spark.table(source)


def _label_values(manifest: Manifest):
    """Label mapping back to values: int64 if every label is an integer (numeric labels), else text."""
    import pyarrow as pa

    values = list(manifest.label_mapping or [])
    try:
        ints = [int(v) for v in values]
        if all(str(i) == v for i, v in zip(ints, values)):
            return ints, pa.int64(), "bigint"
    except ValueError:
        pass
    return values, pa.string(), "string"


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _feature_column(df, spec, source: str):
    """The Spark column the Transform reads for feature `spec`, or a DataError naming the column, its type
    and what the feature needs."""
    from udfs.score import spark_input

    column, needs = spark_input(df, spec.to_dict())
    if column is None:
        raise DataError(f"feature column {spec.name!r} of {source} has type "
                        f"{df.schema[spec.name].dataType.simpleString()}; the {spec.type} feature {spec.name!r} "
                        f"needs {needs}")
    return column


def _prepare(df, features, keep: list[str], source: str, reserved: tuple = ()):
    names = [f.name for f in features]
    missing = [c for c in names if c not in df.columns]
    if missing:
        raise DataError(f"score input {source} lacks {len(missing)} of the model's feature columns: {missing} "
                        f"(columns present: {df.columns}); the model was trained on {names}")
    missing_keep = [c for c in keep if c not in df.columns]
    if missing_keep:
        raise DataError(f"score.keep_columns {missing_keep} are not in the input {source} (columns: {df.columns})")
    clash = [c for c in keep if c in ("prediction", "probability", *reserved)]
    if clash:
        raise DataError(f"score.keep_columns {clash} clash with the output columns "
                        f"{'/'.join(('prediction', 'probability', *reserved))}")
    from pyspark.sql import functions as F

    exprs = [F.col(_quote(c)) for c in keep if c not in names]
    return df.select(*exprs, *[_feature_column(df, spec, source) for spec in features])


def _invalid_counts(df, features: list[str]) -> tuple[int, dict[str, int]]:
    """(invalid rows, invalid values per column) of plain numeric features by one Spark aggregate."""
    from pyspark.sql import functions as F

    def bad(c):
        col = F.col(_quote(c))
        return col.isNull() | F.isnan(col) | (F.abs(col) == float("inf"))

    any_bad = None
    aggs = []
    for c in features:
        aggs.append(F.sum(bad(c).cast("long")).alias(c))
        any_bad = bad(c) if any_bad is None else (any_bad | bad(c))
    row = df.agg(F.sum(any_bad.cast("long")).alias("__rows"), *aggs).collect()[0]
    return int(row["__rows"] or 0), {c: int(row[c] or 0) for c in features if row[c]}


def _reject_counts(df, model: "ScoringModel") -> tuple[int, dict[str, int]]:
    """The reject pre-pass: Spark SQL for plain numeric features (no Python), else the Transform itself
    in a counting UDF (imputation, vector lengths and image decoding have no SQL form)."""
    features = model.manifest.feature_set
    plain = [f.name for f in features if f.type == "numeric" and not f.impute]
    if len(plain) == len(features):
        return _invalid_counts(df, plain)
    from udfs.score import make_validity_fn

    fn = make_validity_fn(features.to_list(), model.vocabularies)
    rows = df.mapInArrow(fn, "rows long, invalid long, by_column array<long>").collect()
    totals = np.sum([r["by_column"] for r in rows], axis=0) if rows else np.zeros(len(features))
    return sum(r["invalid"] for r in rows), {f.name: int(n) for f, n in zip(features, totals) if n}


class _VectorSum:
    """An AccumulatorParam (zero, addInPlace) of equal-length count lists; module level, so pickled by
    reference."""

    def zero(self, value):
        return [0] * len(value)

    def addInPlace(self, a, b):
        return [x + y for x, y in zip(a, b)]


def _vector_accumulator(spark, width: int):
    try:
        context = spark.sparkContext
    except Exception:  # Spark Connect: no accumulators; counts then come from the written output
        return None
    return context.accumulator([0] * width, _VectorSum())  # duck-typed AccumulatorParam


def score(spark, cfg: PipelineConfig, model_uri: str, input: str, output: str) -> ScoreResult:
    """Score `input` (Parquet path or table) with `model_uri`, writing Parquet predictions to `output`, or
    appending them to the Delta table (folder or URL) / Iceberg table (namespace.table) `output`."""
    from udfs.score import make_score_fn

    sc = cfg.score
    started = time.perf_counter()
    table = sc.output_format != "parquet"
    model = load_scoring_model(cfg, model_uri)
    manifest = model.manifest
    feature_set = manifest.feature_set
    features = [f.name for f in feature_set]
    keep = list(dict.fromkeys(sc.keep_columns))
    fs = check_output(spark, cfg, output)
    df = _prepare(_read_input(spark, input), feature_set, keep, input, MODEL_COLUMNS if table else ())

    classification = manifest.task == "classification"
    labels, label_arrow, label_ddl = _label_values(manifest) if classification else (None, None, None)
    ddl = ", ".join([f"{_quote(c)} {df.schema[c].dataType.simpleString()}" for c in keep] +
                    [f"prediction {label_ddl if classification else 'double'}"] +
                    (["probability array<float>"] if classification and sc.probabilities else []))
    counter = _vector_accumulator(spark, 3 + len(features))
    fn = make_score_fn(feature_set.to_list(), model.vocabularies, model_from_flat, model.spec, model.parameters,
                       model.digest, manifest.task, labels, label_arrow, keep, sc.invalid_rows, sc.batch_size,
                       sc.threads_per_worker, sc.probabilities, counter)
    predictions = df.mapInArrow(fn, ddl)
    if table:  # checked before the reject pre-pass and the write: a table that cannot take them fails first
        predictions, writer, target = table_target(cfg, predictions, model_uri, model.version, output)

    if sc.invalid_rows == "reject":
        bad_rows, by_column = _reject_counts(df, model)
        if bad_rows:
            raise DataError(f"score.invalid_rows=reject: {bad_rows} rows of {input} have invalid features "
                            f"(null/NaN/inf numbers, vectors of another length, undecodable images; per column: "
                            f"{by_column}); nothing was written. Fix the input, or set "
                            "score.invalid_rows=drop (leave them out) or keep_null (write null predictions)")

    written_at, version = [output], None
    if table:
        appended = writer.append(predictions, target)
        written_at, version = appended.files, appended.version
    else:
        write_parquet_output(fs, predictions, output, sc.overwrite)
    seconds = time.perf_counter() - started

    if counter is not None:
        counts = counter.value
        input_rows, scored, invalid = int(counts[0]), int(counts[1]), int(counts[2])
        by_column = {c: int(n) for c, n in zip(features, counts[3:]) if n}
    else:
        from pipeline.storage.spark_io import read_parquet

        scored = read_parquet(spark, written_at).where("prediction is not null").count() if written_at else 0
        input_rows, invalid, by_column = df.count(), -1, {}
    written = scored if sc.invalid_rows == "drop" else input_rows
    result = ScoreResult(model_uri, model.run_id, output, input_rows, scored, invalid, by_column, written,
                         seconds, input_rows / max(seconds, 1e-9), columns=predictions.columns,
                         table_version=version)
    log.info("scored %s with %s (run %s): %d input rows, %d scored, %d invalid (%s: %s), %d written to %s "
             "in %.1fs (%.0f rows/s)", input, model_uri, model.run_id, input_rows, scored, invalid,
             sc.invalid_rows, by_column or "none", written, output, seconds, result.rows_per_s)
    if sc.log_to_mlflow:
        result.mlflow_run_id = _log_run(cfg, result, input)
    return result


def _log_run(cfg: PipelineConfig, result: ScoreResult, source: str) -> str:
    from pipeline.tracking import start_run

    name = f"score-{cfg.name}"
    with start_run(_tracking_uri(cfg), cfg.tracking.experiment, name) as run:
        run.log_params({"score.model_uri": result.model_uri, "score.input": source, "score.output": result.output,
                        "score.invalid_rows": cfg.score.invalid_rows, "score.batch_size": cfg.score.batch_size,
                        "score.output_format": cfg.score.output_format})
        run.set_tags({"shardline.kind": "score", "shardline.model_run_id": result.run_id})
        run.log_metrics({"score_input_rows": result.input_rows, "score_scored_rows": result.scored_rows,
                         "score_invalid_rows": result.invalid_rows, "score_written_rows": result.written_rows,
                         "score_seconds": result.seconds, "score_rows_per_s": result.rows_per_s,
                         **{f"score_invalid_{c}": n for c, n in result.invalid_by_column.items()}})
        return run.run_id
