"""Spark ML API: `ShardlineEstimator` / `ShardlineModel`, usable as stages of a `pyspark.ml.Pipeline`.

    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler
    from pipeline.spark_ml import ShardlineEstimator

    stages = [VectorAssembler(inputCols=pixels, outputCol="features"),
              ShardlineEstimator(featuresCol="features", labelCol="label", parallelism=2,
                                 overrides=["train.epochs=10"])]
    model = Pipeline(stages=stages).fit(df)          # ETL -> shards -> barrier training -> test evaluation
    model.write().overwrite().save("/models/digits")  # PipelineModel.load(...) in any later session
    model.transform(df).select("prediction", "probability")

    # Raw typed columns instead of one vector: numbers are numeric features, strings categorical,
    # Vectors/arrays vector features; any other type (images, text) needs its typed data.features entry.
    ShardlineEstimator(inputCols=["age", "city", "photo"], labelCol="label",
                       overrides=["data.features=[{name: photo, type: image, height: 32, width: 32}]"])

`fit` writes the selected input (the vector column expanded to f0..fN-1, or the inputCols as they are with
Vectors as arrays; the label; a row id fixed once) as a Parquet source under the workdir and runs the usual
steps on it: `run_etl` (balanced shards, train-only statistics and vocabularies), `pipeline.launch.train`
(barrier workers), `pipeline.evaluate` on the test split; in an MLflow run of its own when tracking was
asked for (an active run, `tracking.uri`, MLFLOW_TRACKING_URI: pipeline/spark_ml/tracking.py), nested under
an active run — so a `pyspark.ml.tuning` search logs one child run per fit. The fitted `ShardlineModel`
holds the model spec, the flat fp32 state (parameters + buffers), the
fitted features (or, classic, the standardization statistics), the vocabularies and the label values; `transform` scores
with a vectorized Arrow UDF (udfs/predict.py) through udfs.transforms.Transform, the ETL's preprocessing.
Persistence is Spark ML's: params metadata through `DefaultParamsWriter`, the model state as JSON + raw
little-endian float32 bytes (no pickle).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import uuid
from pathlib import Path
from typing import Optional

import numpy as np
from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (HasFeaturesCol, HasLabelCol, HasPredictionCol, HasProbabilityCol,
                                     HasRawPredictionCol)
from pyspark.ml.util import (DefaultParamsReadable, DefaultParamsReader, DefaultParamsWritable,
                             DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter)

from pipeline.config.loader import build, deep_merge, nested, parse_override, read_yaml
from pipeline.config.schema import PipelineConfig
from pipeline.config.workdir import Workdir
from pipeline.errors import ConfigError, DataError
from pipeline.models import model_from_flat
from pipeline.models.trust import check_factory, state_digest, verify_state
from pipeline.spark_ml.inputs import LABEL, ROW_ID, feature_name, input_copy, transform_input

__all__ = ["ShardlineEstimator", "ShardlineModel", "feature_name", "LABEL", "ROW_ID"]

log = logging.getLogger(__name__)

STATE_DIR = "shardline"
STATE_FORMAT = 2  # 2 adds the fitted features and vocabularies; format 1 (classic) still loads


class _ShardlineParams(HasFeaturesCol, HasLabelCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol):
    configPath = Param(Params._dummy(), "configPath",
                       "optional YAML config (layered on conf/base.yaml next to it when present)",
                       typeConverter=TypeConverters.toString)
    overrides = Param(Params._dummy(), "overrides",
                      "config overrides `key.sub=value` (values parsed as YAML), applied last",
                      typeConverter=TypeConverters.toListString)
    workdir = Param(Params._dummy(), "workdir", "working directory for the input copy, shards and checkpoints",
                    typeConverter=TypeConverters.toString)
    name = Param(Params._dummy(), "name", "name of the shard set / model (config `name`)",
                 typeConverter=TypeConverters.toString)
    parallelism = Param(Params._dummy(), "parallelism", "barrier workers (parallelism.data)",
                        typeConverter=TypeConverters.toInt)
    modelKind = Param(Params._dummy(), "modelKind", "model.kind: mlp | logreg",
                      typeConverter=TypeConverters.toString)
    hidden = Param(Params._dummy(), "hidden", "model.hidden layer widths", typeConverter=TypeConverters.toListInt)
    epochs = Param(Params._dummy(), "epochs", "train.epochs", typeConverter=TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", "train.batch_size (per worker)",
                      typeConverter=TypeConverters.toInt)
    learningRate = Param(Params._dummy(), "learningRate", "train.lr", typeConverter=TypeConverters.toFloat)
    backend = Param(Params._dummy(), "backend", "train.backend: ps | allreduce | auto",
                    typeConverter=TypeConverters.toString)
    psMode = Param(Params._dummy(), "psMode", "ps.mode: sync | async | ssp | average | auto",
                   typeConverter=TypeConverters.toString)
    inputCols = Param(Params._dummy(), "inputCols",
                      "raw input columns, one feature each (instead of featuresCol); typed data.features "
                      "entries in the config or overrides refine them", typeConverter=TypeConverters.toListString)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(featuresCol="features", labelCol="label", predictionCol="prediction",
                         probabilityCol="probability", rawPredictionCol="rawPrediction", overrides=[])

    def getConfigPath(self) -> Optional[str]:
        return self.getOrDefault(self.configPath) if self.isDefined(self.configPath) else None

    def getOverrides(self) -> list[str]:
        return list(self.getOrDefault(self.overrides))

    def getInputCols(self) -> list[str]:
        return list(self.getOrDefault(self.inputCols)) if self.isDefined(self.inputCols) else []


# typed Param -> dotted config key
_PARAM_KEYS = {"workdir": "workdir", "name": "name", "parallelism": "parallelism.data", "modelKind": "model.kind",
               "hidden": "model.hidden", "epochs": "train.epochs", "batchSize": "train.batch_size",
               "learningRate": "train.lr", "backend": "train.backend", "psMode": "ps.mode"}


class ShardlineEstimator(Estimator, _ShardlineParams, DefaultParamsReadable, DefaultParamsWritable):
    """Distributed torch training as a Spark ML Estimator; `fit` returns a `ShardlineModel`."""

    @keyword_only
    def __init__(self, *, featuresCol: str = "features", labelCol: str = "label",
                 predictionCol: str = "prediction", probabilityCol: str = "probability",
                 rawPredictionCol: str = "rawPrediction",
                 configPath: Optional[str] = None, overrides: Optional[list[str]] = None,
                 workdir: Optional[str] = None, name: Optional[str] = None, parallelism: Optional[int] = None,
                 modelKind: Optional[str] = None, hidden: Optional[list[int]] = None, epochs: Optional[int] = None,
                 batchSize: Optional[int] = None, learningRate: Optional[float] = None,
                 backend: Optional[str] = None, psMode: Optional[str] = None,
                 inputCols: Optional[list[str]] = None) -> None:
        super().__init__()
        self.setParams(**self._input_kwargs)

    @keyword_only
    def setParams(self, *, featuresCol: str = "features", labelCol: str = "label",
                  predictionCol: str = "prediction", probabilityCol: str = "probability",
                  rawPredictionCol: str = "rawPrediction",
                 configPath: Optional[str] = None, overrides: Optional[list[str]] = None,
                  workdir: Optional[str] = None, name: Optional[str] = None, parallelism: Optional[int] = None,
                  modelKind: Optional[str] = None, hidden: Optional[list[int]] = None, epochs: Optional[int] = None,
                  batchSize: Optional[int] = None, learningRate: Optional[float] = None,
                  backend: Optional[str] = None, psMode: Optional[str] = None,
                  inputCols: Optional[list[str]] = None) -> "ShardlineEstimator":
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        return self._set(**kwargs)

    def pipeline_config(self, input_path: Optional[str] = None, features: Optional[list] = None,
                        overlay: Optional[dict] = None) -> PipelineConfig:
        """The resolved config: configPath (on its base.yaml), then the typed Params, then `overrides`;
        with input_path, the data section points at the Parquet copy of the input frame and its `features`
        (data.features items) replace the configured ones; `overlay` (nested keys) goes on top."""
        merged = self._merged(input_path, features)
        if overlay:
            merged = deep_merge(merged, overlay)
        return build(merged, f"ShardlineEstimator({self.getConfigPath() or 'defaults'})")

    def _merged(self, input_path: Optional[str], features: Optional[list]) -> dict:
        path = self.getConfigPath()
        merged: dict = {}
        if path is not None:
            base = Path(path).parent / "base.yaml"
            if base.exists() and base.resolve() != Path(path).resolve():
                merged = read_yaml(base)
            merged = deep_merge(merged, read_yaml(path))
        for param, key in _PARAM_KEYS.items():
            if self.isDefined(getattr(self, param)):
                merged = deep_merge(merged, nested(key, self.getOrDefault(getattr(self, param))))
        for override in self.getOverrides():
            merged = deep_merge(merged, parse_override(override))
        if input_path is not None:
            data = {"source": "parquet", "path": input_path, "label": LABEL, "id_column": ROW_ID,
                    "features": list(features or [])}
            merged = deep_merge(merged, {"data": data})
        return merged

    def copy(self, extra=None) -> "ShardlineEstimator":
        from pipeline.spark_ml.tracking import current_run

        that = super().copy(extra)
        # Plain values: the run active on the copying thread, for a fit on another (see spark_ml.tracking).
        that._parent_run = current_run() or getattr(self, "_parent_run", None)
        return that

    def _fit(self, dataset) -> "ShardlineModel":
        from pipeline.etl import run_etl
        from pipeline.evaluate import evaluate
        from pipeline.launch import train

        probe = self.pipeline_config()
        target = Workdir.of(probe).spark_ml_input
        features = input_copy(dataset, self.getInputCols(), self.getFeaturesCol(), self.getLabelCol(), probe,
                              target)
        from pipeline.spark_ml.tracking import tracking_overlay

        overlay, tags = tracking_overlay(probe.tracking.uri is not None, getattr(self, "_parent_run", None))
        cfg = self.pipeline_config(str(target), features, overlay)
        spark = dataset.sparkSession
        manifest = run_etl(spark, cfg)
        has_test = "test" in manifest.splits and manifest.split("test").rows > 0
        metrics: dict[str, float] = {}
        if overlay is not None and has_test:  # an MLflow run, as the steps write it (see spark_ml.tracking)
            from pipeline.steps import tracked_training

            tracked = tracked_training(spark, cfg, manifest, tags={"shardline.entry": "spark_ml", **tags})
            result, metrics = tracked.result, dict(tracked.outcome.test_metrics)
            log.info("fit logged MLflow run %s (%s)", tracked.outcome.run_id, tracked.outcome.model_uri)
        else:
            result = train(spark, cfg, manifest)
            if has_test:
                metrics = dict(evaluate(spark, manifest, result.spec, result.parameters, "test").metrics)
        parameters = result.parameters.detach().cpu().numpy().astype(np.float32) \
            if hasattr(result.parameters, "detach") else np.asarray(result.parameters, dtype=np.float32)
        model = ShardlineModel(featuresCol=self.getFeaturesCol(), predictionCol=self.getPredictionCol(),
                               probabilityCol=self.getProbabilityCol(),
                               rawPredictionCol=self.getRawPredictionCol())
        typed = bool(self.getInputCols())
        model._set_state(spec=result.spec.to_dict(), parameters=parameters, means=list(manifest.means),
                         stds=list(manifest.stds), task=manifest.task,
                         labels=None if manifest.label_mapping is None else list(manifest.label_mapping),
                         metrics=metrics, history=list(result.history),
                         features=manifest.feature_set.to_list() if typed else None,
                         vocabularies={k: v.to_pylist() for k, v in manifest.vocabularies().items()} if typed else {})
        return self._copyValues(model)


def _label_values(labels: Optional[list[str]]) -> Optional[list[float]]:
    """Class index -> the original label value as a double (numeric labels); None for text labels."""
    if labels is None:
        return None
    try:
        return [float(v) for v in labels]
    except ValueError:
        return None


def _local_dir(path: str) -> Path:
    if path.startswith("file:"):
        return Path("/" + path[len("file:"):].lstrip("/"))
    if "://" in path:
        raise ConfigError(f"ShardlineModel saves its state on the local filesystem; {path!r} is not a local path")
    return Path(path)


class ShardlineModel(Model, _ShardlineParams, MLReadable, MLWritable):
    """A trained shardline model as a Spark ML Transformer: adds `prediction` (double; the original label
    value for numeric classification labels, the class index into `labels` for text labels, the output
    for regression) and, for classification, `probability` (a Vector of class probabilities)."""

    @keyword_only
    def __init__(self, *, featuresCol: str = "features", predictionCol: str = "prediction",
                 probabilityCol: str = "probability", rawPredictionCol: str = "rawPrediction") -> None:
        super().__init__()
        self._set(**self._input_kwargs)
        self._state: Optional[dict] = None

    def _set_state(self, *, spec: dict, parameters: np.ndarray, means: list[float], stds: list[float], task: str,
                   labels: Optional[list[str]], metrics: dict, history: list, features: Optional[list] = None,
                   vocabularies: Optional[dict] = None) -> None:
        """features: the fitted FeatureSpec dicts of a model fitted on inputCols (None: the classic
        featuresCol vector, standardized with means/stds); vocabularies: name -> values, id order."""
        self._state = {"spec": spec, "parameters": np.ascontiguousarray(parameters, dtype=np.float32),
                       "means": [float(v) for v in means], "stds": [float(v) for v in stds], "task": task,
                       "labels": labels, "metrics": {k: float(v) for k, v in metrics.items()},
                       "history": history, "features": features,
                       "vocabularies": {k: list(v) for k, v in (vocabularies or {}).items()}}

    def _require_state(self) -> dict:
        if self._state is None:
            raise ConfigError("this ShardlineModel holds no trained model (fit an estimator or load a saved one)")
        return self._state

    @property
    def spec(self) -> dict:
        return dict(self._require_state()["spec"])

    @property
    def parameters(self) -> np.ndarray:
        return self._require_state()["parameters"]

    @property
    def labels(self) -> Optional[list[str]]:
        return self._require_state()["labels"]

    @property
    def metrics(self) -> dict[str, float]:
        """Test-split metrics measured at fit time."""
        return dict(self._require_state()["metrics"])

    def torch_model(self):
        return model_from_flat(self.spec, self.parameters)

    def copy(self, extra=None) -> "ShardlineModel":
        that = super().copy(extra)
        that._state = self._state
        return that

    def _key(self) -> str:
        state = self._require_state()
        digest = hashlib.sha256(json.dumps(state["spec"], sort_keys=True).encode())
        digest.update(state["parameters"].tobytes())
        return digest.hexdigest()

    def _transform(self, dataset):
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        from udfs.predict import RESULT_DDL, make_arrow_predict_fn, make_pandas_predict_fn, make_scorer

        state = self._require_state()
        column, specs, classic = transform_input(dataset, state["features"], self.getFeaturesCol(),
                                                 state["means"], state["stds"])
        build = functools.partial(model_from_flat, state["spec"], state["parameters"])
        classification = state["task"] == "classification"
        scorer = make_scorer(self._key(), build, specs, state["vocabularies"], state["task"],
                             _label_values(state["labels"]) if classification else None)
        try:
            from pyspark.sql.functions import arrow_udf  # pyspark >= 4.1
        except ImportError:
            from pyspark.sql.functions import pandas_udf

            udf = pandas_udf(make_pandas_predict_fn(scorer, classic), RESULT_DDL)
        else:
            udf = arrow_udf(make_arrow_predict_fn(scorer, classic), RESULT_DDL)
        tmp = f"__shardline_{uuid.uuid4().hex[:8]}"
        scored = dataset.select("*", udf(column).alias(tmp))
        outputs = [F.col(f"{tmp}.prediction").alias(self.getPredictionCol())]
        if classification and self.getProbabilityCol():
            outputs.append(array_to_vector(F.col(f"{tmp}.probability")).alias(self.getProbabilityCol()))
        if classification and self.getRawPredictionCol():
            # Log-probabilities: the logits up to a per-row constant, which is all a ranking evaluator
            # (BinaryClassificationEvaluator's areaUnderROC/PR) reads; floored so a 0 stays finite.
            logp = F.transform(F.col(f"{tmp}.probability"), lambda p: F.log(F.greatest(p, F.lit(1e-38))))
            outputs.append(array_to_vector(logp).alias(self.getRawPredictionCol()))
        replaced = {self.getPredictionCol(), self.getProbabilityCol(), self.getRawPredictionCol()}
        return scored.select(*[F.col(f"`{c}`") for c in dataset.columns if c not in replaced], *outputs)

    def write(self) -> "ShardlineModelWriter":
        return ShardlineModelWriter(self)

    @classmethod
    def read(cls) -> "ShardlineModelReader":
        return ShardlineModelReader(cls)


class ShardlineModelWriter(MLWriter):
    """Params metadata via DefaultParamsWriter; state as spec/stats JSON + raw little-endian float32."""

    def __init__(self, instance: ShardlineModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        state = self.instance._require_state()
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession,
                                         extraMetadata={"shardlineStateFormat": STATE_FORMAT})
        folder = _local_dir(path) / STATE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        raw = state["parameters"].astype("<f4").tobytes()
        (folder / "parameters.f32").write_bytes(raw)
        info = {"format": STATE_FORMAT, "spec": state["spec"], "means": state["means"], "stds": state["stds"],
                "task": state["task"], "labels": state["labels"], "metrics": state["metrics"],
                "history": state["history"], "num_parameters": int(state["parameters"].size),
                "parameters_sha256": hashlib.sha256(raw).hexdigest(), "features": state["features"],
                "state_digest": state_digest(state["spec"], raw),
                "vocabularies": state["vocabularies"]}
        (folder / "state.json").write_text(json.dumps(info, indent=1))


class ShardlineModelReader(MLReader):
    """Loads a saved ShardlineModel. A model built by a ``model.factory`` loads only when that factory is
    allowed: :meth:`allowFactories`, or the comma-separated ``$SHARDLINE_ALLOWED_FACTORIES`` (the saved
    state is data: it must not choose which code runs)."""

    def __init__(self, cls) -> None:
        super().__init__()
        self.cls = cls
        self._allowed: set[str] = set()

    def allowFactories(self, *factories: str) -> "ShardlineModelReader":
        self._allowed.update(factories)
        return self

    def _allowed_factories(self) -> set[str]:
        import os

        listed = os.environ.get("SHARDLINE_ALLOWED_FACTORIES", "")
        return self._allowed | {f.strip() for f in listed.split(",") if f.strip()}

    def load(self, path: str) -> ShardlineModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        model = self.cls()
        DefaultParamsReader.getAndSetParams(model, metadata)
        model._resetUid(metadata["uid"])
        folder = _local_dir(path) / STATE_DIR
        try:
            info = json.loads((folder / "state.json").read_text())
            raw = (folder / "parameters.f32").read_bytes()
        except FileNotFoundError as exc:
            raise DataError(f"{path} is not a saved ShardlineModel: {exc.filename} is missing") from None
        if info.get("format") not in (1, STATE_FORMAT):
            raise DataError(f"{folder}: state format {info.get('format')} is not 1 or {STATE_FORMAT}")
        if hashlib.sha256(raw).hexdigest() != info["parameters_sha256"] or len(raw) != 4 * info["num_parameters"]:
            raise DataError(f"{folder / 'parameters.f32'} does not match state.json (corrupt or replaced)")
        check_factory(info["spec"], self._allowed_factories(), f"saved ShardlineModel {path}")
        if "state_digest" in info:  # older saves carry parameters_sha256 only (checked above)
            verify_state(info["spec"], raw, info["state_digest"], f"saved ShardlineModel {path}")
        parameters = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        model._set_state(spec=info["spec"], parameters=parameters, means=info["means"], stds=info["stds"],
                         task=info["task"], labels=info["labels"], metrics=info["metrics"],
                         history=info.get("history", []), features=info.get("features"),
                         vocabularies=info.get("vocabularies"))
        return model
