"""One MLflow run: params, per-epoch metrics, evaluation artifacts, curves and the model."""
from __future__ import annotations

import logging
import numbers
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from pipeline.config.feature_spec import FeatureSet
from pipeline.errors import ShardlineError
from pipeline.tracking.params import flatten_params
from pipeline.tracking.plots import confusion_figure, history_figure, stage_figure
from pipeline.tracking.uri import sqlite_artifact_location

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

logger = logging.getLogger(__name__)

MODEL_NAME = "model"
DATA_DIR = "data"  # the manifest and vocabularies of the training shard set
VOCAB_ARTIFACT_DIR = f"{DATA_DIR}/vocab"
MANIFEST_FILE = "manifest.json"  # pipeline.shards.MANIFEST_NAME; tracking does not import the shards module
_PARAMS_PER_BATCH = 100  # mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
_METRICS_PER_BATCH = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH


class TrackingError(ShardlineError):
    """The tracking store refused an experiment or run. The message names the experiment and the fix."""


def _now_ms() -> int:
    return int(time.time() * 1000)


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _numeric(metrics: Mapping[str, object]) -> dict[str, float]:
    """Metric values as floats; the ``epoch`` key and non-numeric values are dropped (the latter with a warning)."""
    values, skipped = {}, []
    for key, value in metrics.items():
        if key == "epoch":
            continue
        if isinstance(value, (numbers.Real, np.number)) and not isinstance(value, bool):
            values[key] = float(value)
        elif isinstance(value, np.ndarray) and value.size == 1:
            values[key] = float(value.item())
        else:
            skipped.append(key)
    if skipped:
        logger.warning("not logging non-numeric metrics: %s", ", ".join(map(str, skipped)))
    return values


def per_class_report(confusion: np.ndarray, class_names: Sequence[str]) -> dict:
    """Precision, recall, F1 and support per class from a confusion matrix (rows = true class)."""
    matrix = np.asarray(confusion, dtype=np.float64)
    correct = np.diag(matrix)
    predicted, actual = matrix.sum(axis=0), matrix.sum(axis=1)
    report = {}
    for i, name in enumerate(class_names):
        precision = correct[i] / predicted[i] if predicted[i] else 0.0
        recall = correct[i] / actual[i] if actual[i] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        report[str(name)] = {"precision": round(float(precision), 6), "recall": round(float(recall), 6),
                             "f1": round(float(f1), 6), "support": int(actual[i])}
    return report


class TrackedRun:
    """An active MLflow run. Use as a context manager: the run ends FAILED if the block raises, else FINISHED."""

    def __init__(self, client, run_id: str, experiment_id: str, tracking_uri: str) -> None:
        self._client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.tracking_uri = tracking_uri
        self._ended = False

    def __repr__(self) -> str:
        return f"TrackedRun(run_id={self.run_id!r}, experiment_id={self.experiment_id!r}, tracking_uri={self.tracking_uri!r})"

    def __enter__(self) -> TrackedRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.end("FINISHED")
        else:
            self.end("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")
        return False

    def end(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (FINISHED, FAILED or KILLED). Later calls do nothing."""
        if self._ended:
            return
        import mlflow

        self._ended = True
        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            mlflow.end_run(status)
        else:
            self._client.set_terminated(self.run_id, status)
        logger.info("run %s ended %s", self.run_id, status)

    def log_params(self, params: Mapping[str, object]) -> None:
        """Log params; nested mappings are flattened to dotted keys."""
        from mlflow.entities import Param

        entries = [Param(k, v) for k, v in flatten_params(params).items()]
        for batch in _chunks(entries, _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=batch)

    def log_metrics(self, metrics: Mapping[str, float], prefix: str = "", step: int = 0) -> None:
        """Log metrics as ``<prefix><name>`` at ``step``."""
        from mlflow.entities import Metric

        stamp = _now_ms()
        entries = [Metric(f"{prefix}{k}", v, stamp, step) for k, v in _numeric(metrics).items()]
        for batch in _chunks(entries, _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch)

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """Log one epoch's metrics (train_loss, val_loss, val_accuracy, samples_per_s, ...) at step=epoch."""
        self.log_metrics(metrics, step=int(epoch))

    def logged_epochs(self, metric: str = "train_loss") -> set[int]:
        """The epochs whose ``metric`` this run already holds (a resumed run continues an MLflow run that
        may have logged epochs after its last checkpoint: they are not logged twice)."""
        return {int(m.step) for m in self._client.get_metric_history(self.run_id, metric)}

    def log_evaluation(self, metrics: Mapping[str, float], confusion: np.ndarray | None = None,
                       class_names: Sequence[str] | None = None) -> None:
        """Log ``test_<name>`` metrics, and the confusion matrix as PNG and JSON under ``evaluation/``."""
        self.log_metrics(metrics, prefix="test_")
        if confusion is None:
            return
        matrix = np.asarray(confusion)
        if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"confusion matrix must be square, got shape {matrix.shape}")
        names = [str(c) for c in class_names] if class_names is not None else [str(i) for i in range(len(matrix))]
        if len(names) != len(matrix):
            raise ValueError(f"{len(names)} class_names for a {len(matrix)}-class confusion matrix")
        self._client.log_dict(self.run_id, {"class_names": names, "matrix": matrix.tolist()},
                              "evaluation/confusion_matrix.json")
        self._client.log_figure(self.run_id, confusion_figure(matrix, names), "evaluation/confusion_matrix.png")
        self._client.log_dict(self.run_id, per_class_report(matrix, names), "evaluation/per_class_report.json")

    def log_dataset(self, name: str, source_uri: str, digest: str, num_features: int, label_dtype: str,
                    context: str = "training") -> None:
        """Record dataset lineage: the shard set's location and content fingerprint as a run input."""
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.types.schema import Schema, TensorSpec

        schema = Schema([TensorSpec(np.dtype("float32"), (-1, num_features), "features"),
                         TensorSpec(np.dtype(label_dtype), (-1,), "label")])
        with warnings.catch_warnings():  # a local path matches two equivalent source types
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(source_uri)
        dataset = MetaDataset(source=source, name=name, digest=digest[:36], schema=schema)
        self._client.log_inputs(self.run_id, datasets=[
            DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])

    def log_source_table(self, table: dict, rows, fingerprint: str) -> None:
        """The Delta/Iceberg table and version the shard set was made from, as a run input (lineage)."""
        from pipeline.tracking.lineage import table_input

        self._client.log_inputs(self.run_id, datasets=[table_input(table, rows, fingerprint)])

    def log_history(self, history: Sequence[Mapping[str, float]]) -> None:
        """Plot loss/accuracy curves from per-epoch dicts to ``plots/training_curves.png`` (and, with
        pipeline stages, their compute/idle time to ``plots/pipeline_stages.png``)."""
        stages = stage_figure(history)
        if stages is not None:
            self._client.log_figure(self.run_id, stages, "plots/pipeline_stages.png")
        figure = history_figure(history)
        if figure is None:
            logger.warning("history has no loss or accuracy keys; no curves logged for run %s", self.run_id)
            return
        self._client.log_figure(self.run_id, figure, "plots/training_curves.png")

    def log_model(self, model, features: FeatureSet, vocabulary_files: dict[str, str], task: str,
                  label_values: list[str] | None, input_example, registered_model_name: str | None = None) -> str:
        """Log ``model`` (whose forward takes the batch dict) as the run's ``model``, a pyfunc that predicts
        from RAW source rows; return its model URI.

        ``features`` is the shard set's FeatureSet (``Manifest.feature_set``), ``vocabulary_files`` its
        ``Manifest.vocabulary_files()``, ``label_values`` the class values in class-index order
        (``Manifest.label_mapping``; None for regression) and ``input_example`` a pandas DataFrame of raw
        source rows (``served.input_example``'s output or Spark's ``toPandas()``; invalid ones are left out,
        the first 5 valid ones kept). The network is exported on CPU in eval mode, the
        module's training mode is restored. Loading needs mlflow, torch, numpy, pandas, pyarrow (and
        pillow for images), never shardline: see pipeline.tracking.served.
        """
        from pipeline.tracking.served import log_served_model

        return log_served_model(self.run_id, self.tracking_uri, model, features, vocabulary_files, task,
                                label_values, input_example, registered_model_name)

    def log_manifest(self, manifest) -> None:
        """The shard set's manifest.json as ``data/manifest.json`` and its vocabularies as
        ``data/vocab/<feature>.parquet``: what ``shardline score`` rebuilds the Transform from."""
        from pipeline import storage

        if not storage.is_remote(manifest.root):
            self.log_file(Path(manifest.root) / MANIFEST_FILE, DATA_DIR)
        else:  # mlflow uploads local files only
            import tempfile

            with tempfile.TemporaryDirectory(prefix="shardline-manifest-") as tmp:
                (Path(tmp) / MANIFEST_FILE).write_bytes(storage.read_bytes(storage.join(manifest.root, MANIFEST_FILE)))
                self.log_file(Path(tmp) / MANIFEST_FILE, DATA_DIR)
        self.log_vocabularies(manifest)

    def log_vocabularies(self, manifest) -> None:
        """Each vocabulary file of ``manifest`` as ``data/vocab/<feature>.parquet`` (none: nothing)."""
        import shutil
        import tempfile

        from pipeline import storage

        files = manifest.vocabulary_files()
        if not files:
            return
        with tempfile.TemporaryDirectory(prefix="shardline-vocab-") as tmp:
            for name, path in files.items():
                if os.sep in name or name in (".", ".."):
                    raise TrackingError(f"feature name {name!r} cannot name a vocabulary artifact")
                if storage.is_remote(path):
                    (Path(tmp) / f"{name}.parquet").write_bytes(storage.read_bytes(path))
                else:
                    shutil.copyfile(path, Path(tmp) / f"{name}.parquet")
            self._client.log_artifacts(self.run_id, tmp, VOCAB_ARTIFACT_DIR)

    def log_file(self, path: str | os.PathLike, artifact_dir: str | None = None) -> None:
        """Upload a local file (e.g. the shard manifest.json) as an artifact, under ``artifact_dir`` if given."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cannot log {path} to run {self.run_id}: not a file")
        self._client.log_artifact(self.run_id, str(path), artifact_dir)

    def log_strategy(self, pick: str, predicted_step_ms: float, table: str, record: Mapping[str, object], *,
                     resume: bool = False) -> None:
        """train.backend=auto's choice: the params strategy.pick and strategy.predicted_step_ms (not again on a
        resumed run: MLflow refuses to change a param), the tag shardline.strategy, and the table and every
        figure as the artifacts strategy/candidates.md and strategy/candidates.json."""
        if not resume:
            self.log_params({"strategy.pick": pick, "strategy.predicted_step_ms": round(predicted_step_ms, 3)})
        self.set_tags({"shardline.strategy": pick})
        self._client.log_text(self.run_id, table + "\n", "strategy/candidates.md")
        self._client.log_dict(self.run_id, dict(record), "strategy/candidates.json")

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        entries = [RunTag(k, str(v)) for k, v in tags.items()]
        for batch in _chunks(entries, _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=batch)


def _experiment_id(client, tracking_uri: str, experiment: str) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(experiment)
    if found is None:
        try:
            return client.create_experiment(
                experiment, artifact_location=sqlite_artifact_location(tracking_uri, experiment))
        except MlflowException:
            found = client.get_experiment_by_name(experiment)  # another process created it first
            if found is None:
                raise
    if found.lifecycle_stage != "active":
        raise TrackingError(
            f"experiment {experiment!r} at {tracking_uri} is deleted; restore it "
            f"(mlflow experiments restore --experiment-id {found.experiment_id}) or set another experiment name")
    return found.experiment_id


def start_run(tracking_uri: str, experiment: str, run_name: str | None = None,
              tags: Mapping[str, str] | None = None, run_id: str | None = None,
              system_metrics_interval_s: float | None = None) -> TrackedRun:
    """Start a run in ``experiment`` (created if missing) at ``tracking_uri``, or reopen ``run_id``.

    Reopening lets a later step (evaluate after train) log into the run of the step before it.

    Also makes ``tracking_uri`` MLflow's process-wide tracking URI, which ``Model.log``
    and ``models:/`` URIs rely on. ``system_metrics_interval_s`` samples this machine into the run as
    ``system/*`` metrics from a background thread while it is open.
    """
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri)
    # Started inside another run (the workflow's): a nested run, shown under it.
    nested = mlflow.active_run() is not None
    system = system_metrics_interval_s is not None
    if system:
        mlflow.set_system_metrics_sampling_interval(system_metrics_interval_s)
    if run_id is not None:
        try:
            experiment_id = client.get_run(run_id).info.experiment_id
        except Exception as exc:
            raise TrackingError(f"cannot reopen MLflow run {run_id} at {tracking_uri} ({exc}); "
                                "run the train step again or point tracking.uri at its store") from None
        run = mlflow.start_run(run_id=run_id, tags={k: str(v) for k, v in (tags or {}).items()}, nested=nested,
                               log_system_metrics=system)
    else:
        experiment_id = _experiment_id(client, tracking_uri, experiment)
        run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name,
                               tags={k: str(v) for k, v in (tags or {}).items()}, nested=nested,
                               log_system_metrics=system)
    logger.info("started run %s (%s) in experiment %s at %s", run.info.run_id, run.info.run_name,
                experiment, tracking_uri)
    return TrackedRun(client, run.info.run_id, experiment_id, tracking_uri)


def active_run_store() -> tuple[str, str, str] | None:
    """(tracking URI, experiment name, run id) of the MLflow run active in this process, or None: where a
    run started now (``start_run``) nests under it."""
    import mlflow
    from mlflow import MlflowClient

    active = mlflow.active_run()
    if active is None:
        return None
    uri = mlflow.get_tracking_uri()
    return uri, MlflowClient(uri).get_experiment(active.info.experiment_id).name, active.info.run_id
