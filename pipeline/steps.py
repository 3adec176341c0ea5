"""The pipeline's steps as library calls: etl, train, evaluate, and all three in one MLflow run.

Each step is usable alone (jobs/, notebooks/, the CLI): train saves the merged model under the workdir
and remembers its MLflow run, so a later evaluate step logs into the same run.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline import storage
from pipeline.config.schema import PipelineConfig
from pipeline.config.workdir import Workdir
from pipeline.errors import ConfigError, ShardlineError
from pipeline.shards import Manifest, load_manifest

log = logging.getLogger(__name__)


@dataclass
class PipelineOutcome:
    run_id: str
    tracking_uri: str
    test_metrics: dict[str, float]
    train_seconds: float
    model_uri: Optional[str] = None
    trained_on: Optional[str] = None  # the source and version, the rows and the shard set's fingerprint


@dataclass
class Promotion:
    alias: str  # champion | challenger
    version: str
    reason: str
    new_metric: float
    champion_metric: Optional[float] = None


def model_dir(cfg: PipelineConfig) -> Path | str:
    return Workdir.of(cfg).models


def etl(spark, cfg: PipelineConfig) -> Manifest:
    from pipeline.etl import run_etl
    from pipeline.launch.hosts import check_shared_storage

    check_shared_storage(spark, cfg, etl=True)
    return run_etl(spark, cfg)


def generate(spark, cfg: PipelineConfig) -> Path:
    """Land the synthetic data set of `cfg.data.synthetic` as raw Parquet (regenerated every time)."""
    from pipeline.errors import ConfigError
    from pipeline.etl.synthetic import generate as land_synthetic

    if cfg.data.source != "synthetic":
        raise ConfigError(f"`generate` makes the synthetic source, but data.source={cfg.data.source}; "
                          "set data.source=synthetic (e.g. --config conf/synthetic.yaml)")
    return land_synthetic(spark, cfg.data, cfg.workdir, force=True)


def load_shards(cfg: PipelineConfig) -> Manifest:
    return load_manifest(Workdir.of(cfg).shards)


MODEL_ARTIFACT_DIR = "shardline"


def _save_model(cfg: PipelineConfig, result, run_id: str) -> bytes:
    """The merged model as spec + flat state (parameters + buffers, pipeline.models.state), saved to
    train.model_dir (any store) and returned; loaded back with torch.load(weights_only=True)."""
    import io

    import torch

    from pipeline.models.trust import seal_model

    buffer = io.BytesIO()
    torch.save(seal_model(result.spec.to_dict(), result.parameters), buffer)
    storage.write_atomic(storage.join(model_dir(cfg), "model.pt"), buffer.getvalue())
    _record_model_uri(cfg, run_id, None)
    return buffer.getvalue()


def _record_model_uri(cfg: PipelineConfig, run_id: str, model_uri: Optional[str]) -> None:
    record = {"run_id": run_id, "model_uri": model_uri}
    storage.write_atomic(storage.join(model_dir(cfg), "last_run.json"), json.dumps(record).encode())


def _last_run(cfg: PipelineConfig) -> dict:
    path = storage.join(model_dir(cfg), "last_run.json")
    return json.loads(storage.read_bytes(path)) if storage.exists(path) else {}


def load_saved_model(cfg: PipelineConfig):
    """(ModelSpec, flat state (parameters + buffers), run_id) saved by the last train step of this config."""
    import io

    import torch

    from pipeline.models import ModelSpec

    path = storage.join(model_dir(cfg), "model.pt")
    if not storage.exists(path):
        raise ShardlineError(f"no trained model at {path}; run `shardline train` (or `shardline run`) first")
    from pipeline.models.trust import allowed_factories, open_model

    raw = io.BytesIO(storage.read_bytes(path))
    state = open_model(torch.load(raw, weights_only=True), allowed_factories(cfg.model), str(path))
    return ModelSpec.from_dict(state["spec"]), state["parameters"], _last_run(cfg).get("run_id")


def tracking_uri(cfg: PipelineConfig) -> str:
    from pipeline.tracking import tracking_uri_of

    return tracking_uri_of(cfg)


def _input_example(spark, cfg: PipelineConfig, manifest: Manifest, rows: int = 64):
    """Some RAW source rows (the served model's input form; log_model keeps the first valid ones)."""
    from pipeline.etl.pinning import data_as_etled
    from pipeline.etl.sources import read_source
    from pipeline.tracking.served import input_example

    features = manifest.feature_set
    raw = read_source(spark, data_as_etled(cfg.data, manifest.etl_report), cfg.workdir)
    raw = raw.select(*[f"`{f.name}`" for f in features]).limit(64)
    return input_example(raw.toPandas(), features, rows)


def _resume_run_id(cfg: PipelineConfig, resume: bool) -> Optional[str]:
    """The MLflow run a resumed training continues (recorded in its newest checkpoint)."""
    if not resume:
        return None
    from pipeline.checkpoints import CheckpointStore

    store = CheckpointStore(Workdir.of(cfg).checkpoints, cfg.train.keep_checkpoints)
    latest = store.latest()
    if latest is None:
        raise ConfigError(f"--resume: no checkpoint in {store.directory} (train.checkpoint_dir); "
                          "start without --resume")
    return store.load(latest).get("extra", {}).get("mlflow_run_id")


def _train_into(run, spark, cfg: PipelineConfig, manifest: Manifest, resume: bool = False,
                initial_parameters=None, on_epoch=None, stoppable: bool = False):
    from pipeline.launch import train as launch_train
    from pipeline.launch.elastic import fit_workers
    from pipeline.launch.train import resolve_strategy

    asked = cfg.parallelism.data
    cfg = fit_workers(spark, cfg)  # train.min_workers: the params say what ran, and what was asked
    cfg, strategy = resolve_strategy(spark, cfg, manifest, resume=resume)  # auto keys: the params say what ran
    if not resume:  # a resumed run logged its params already (MLflow refuses to change them)
        run.log_params({**cfg.model_dump(mode="json"), **({"parallelism.data_asked": asked}
                                                          if asked != cfg.parallelism.data else {})})
    if strategy is not None:
        run.log_strategy(strategy.pick.name, strategy.predicted.step_s * 1e3, strategy.table(), strategy.to_dict(),
                         resume=resume)
    run.set_tags({"shardline.fingerprint": manifest.fingerprint, "shardline.workers": str(cfg.parallelism.data)})
    run.log_manifest(manifest)  # manifest.json + vocabularies: what scoring rebuilds the preprocessing from
    run.log_dataset(f"{manifest.name}-train", manifest.root, manifest.fingerprint.removeprefix("sha256:"),
                    manifest.num_features, "int64" if manifest.task == "classification" else "float32")
    if manifest.etl_report.get("table"):  # a Delta/Iceberg source: the table and version, with the shards' fingerprint
        run.log_source_table(manifest.etl_report["table"], manifest.etl_report.get("input_rows"), manifest.fingerprint)

    # --resume: epochs the killed driver logged after its last checkpoint are trained again; logged once. So
    # are epochs a retry replays from a checkpoint taken before their end (a lost shard, an elastic resume).
    logged = run.logged_epochs() if resume else set()

    def log_epoch(row: dict) -> Optional[str]:  # called live from the PS thread as each epoch completes
        if int(row["epoch"]) not in logged:
            logged.add(int(row["epoch"]))
            run.log_epoch(row["epoch"], {k: v for k, v in row.items() if k not in ("epoch", "step")})
        return on_epoch(row) if on_epoch is not None else None  # a reason to stop (launch.train stoppable)

    result = launch_train(spark, cfg, manifest, on_epoch=log_epoch, resume=resume,
                          checkpoint_extra={"mlflow_run_id": run.run_id}, initial_parameters=initial_parameters,
                          stoppable=stoppable, strategy=strategy)
    if result.resumed_from_step is not None:
        run.set_tags({"shardline.resumed_from_step": str(result.resumed_from_step)})
    if result.failed_attempts:
        run.set_tags({"shardline.failed_attempts": str(len(result.failed_attempts))})
    run.log_history(result.history)
    from pipeline.launch.monitor import report_stop

    report_stop(run, cfg, result.stopped)  # best-epoch tags; a divergence with on_divergence=fail raises here
    run.log_metrics({"train_seconds": result.seconds, "train_steps": result.steps,
                     "train_samples_per_s": sum(r["samples"] for r in result.ranks) / max(result.seconds, 1e-9)})
    sparse = result.ps_stats.get("sparse")
    if sparse:  # ps.sparse: rows, admission and eviction counts per table, as sparse/<table>/<count>
        run.log_metrics({f"{t}/{k}": float(v) for t, counts in sparse["tables"].items() for k, v in counts.items()}
                        | {k: float(v) for k, v in sparse.items() if k != "tables"}, prefix="sparse/")
    if cfg.train.profile:  # the server's side of the breakdown (pipeline.ps.server.timing), as ps/time_*
        run.log_metrics({k: v for k, v in result.ps_stats.items() if k.startswith(("time_", "timed_"))},
                        prefix="ps/")
    saved = _save_model(cfg, result, run.run_id)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardline-model-") as tmp:  # mlflow logs local files only
        (Path(tmp) / "model.pt").write_bytes(saved)
        run.log_file(Path(tmp) / "model.pt", MODEL_ARTIFACT_DIR)  # spec + flat parameters: what promotion re-scores with
    return result


def _evaluate_into(run, spark, cfg: PipelineConfig, manifest: Manifest, spec, parameters):
    from pipeline.evaluate import evaluate

    evaluation = evaluate(spark, manifest, spec, parameters, "test")
    run.log_evaluation(evaluation.metrics, evaluation.confusion, evaluation.class_names)
    return evaluation


def _log_model(run, spark, cfg: PipelineConfig, manifest: Manifest, spec, parameters) -> Optional[str]:
    """The self-contained served model: raw source columns in, label values and probabilities out."""
    if not cfg.tracking.log_model:
        return None
    from pipeline.models import build_model, load_flat_state

    model = build_model(spec)
    load_flat_state(model, parameters)
    model.eval()
    _log_sparse_tables(run, spec, model)
    labels = list(manifest.label_mapping) if manifest.task == "classification" else None
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardline-vocab-") as tmp:
        vocabularies = manifest.vocabulary_files()
        if storage.is_remote(manifest.root):  # the served model is built from local copies
            for name, url in vocabularies.items():
                vocabularies[name] = os.path.join(tmp, f"{len(os.listdir(tmp))}.parquet")
                Path(vocabularies[name]).write_bytes(storage.read_bytes(url))
        return run.log_model(model, manifest.feature_set, vocabularies, manifest.task, labels,
                             _input_example(spark, cfg, manifest), cfg.tracking.registered_model)


def _log_sparse_tables(run, spec, model) -> None:
    """ps.sparse: each table's rows as ``sparse_tables/<name>/{ids,rows}.npy`` beside the model (loadable with
    numpy alone), and into the served network as searchsorted lookups (pipeline.models.sparse_embedding)."""
    if not spec.sparse.get("tables"):
        return
    from pipeline.models.sparse_embedding import freeze_sparse

    for name in sorted(os.listdir(spec.sparse["tables"])):
        for part in ("ids.npy", "rows.npy"):
            run.log_file(os.path.join(spec.sparse["tables"], name, part), f"sparse_tables/{name}")
    freeze_sparse(model)


def train(spark, cfg: PipelineConfig, resume: bool = False) -> PipelineOutcome:
    """Train on the existing shard set; one MLflow run with params, per-epoch metrics and the model.
    resume=True continues from the newest checkpoint, in the MLflow run that wrote it."""
    from pipeline.tracking import start_run

    manifest = load_shards(cfg)
    run_id = _resume_run_id(cfg, resume)
    with start_run(tracking_uri(cfg), cfg.tracking.experiment, cfg.tracking.run_name, run_id=run_id,
                   system_metrics_interval_s=cfg.tracking.system_metrics_interval_s) as run:
        result = _train_into(run, spark, cfg, manifest, resume)
        model_uri = _log_model(run, spark, cfg, manifest, result.spec, result.parameters)
        _record_model_uri(cfg, run.run_id, model_uri)
    return PipelineOutcome(run.run_id, run.tracking_uri, {}, result.seconds, model_uri)


def evaluate(spark, cfg: PipelineConfig):
    """Evaluate the last trained model of this config on the test split, logging into its MLflow run."""
    from pipeline.tracking import start_run

    manifest = load_shards(cfg)
    spec, parameters, run_id = load_saved_model(cfg)
    with start_run(tracking_uri(cfg), cfg.tracking.experiment, cfg.tracking.run_name, run_id=run_id) as run:
        evaluation = _evaluate_into(run, spark, cfg, manifest, spec, parameters)
    return PipelineOutcome(run.run_id, run.tracking_uri, evaluation.metrics, 0.0)


def run_all(spark, cfg: PipelineConfig, resume: bool = False) -> PipelineOutcome:
    """ETL, then training, evaluation and model logging in one MLflow run."""
    return train_and_evaluate(spark, cfg, etl(spark, cfg), resume=resume)


def train_and_evaluate(spark, cfg: PipelineConfig, manifest: Manifest, resume: bool = False,
                       initial_parameters=None, tags: Optional[dict] = None) -> PipelineOutcome:
    """Training, evaluation and model logging on a shard set, in one MLflow run."""
    return tracked_training(spark, cfg, manifest, resume, initial_parameters, tags).outcome


@dataclass
class TrackedTraining:
    """What ``tracked_training`` did: the run's outcome, and the training result itself (spec, merged
    state, history) for a caller that keeps the model (the Spark ML estimator)."""

    outcome: PipelineOutcome
    result: object  # pipeline.launch.TrainResult


def tracked_training(spark, cfg: PipelineConfig, manifest: Manifest, resume: bool = False,
                     initial_parameters=None, tags: Optional[dict] = None, on_epoch=None,
                     stoppable: bool = False) -> TrackedTraining:
    """``train_and_evaluate``, also handing back the training result. Nested under an active MLflow run.
    ``on_epoch(row)`` sees each epoch row live; with ``stoppable`` a str it returns stops training there."""
    from pipeline.tracking import start_run

    run_id = _resume_run_id(cfg, resume)
    with start_run(tracking_uri(cfg), cfg.tracking.experiment, cfg.tracking.run_name, run_id=run_id,
                   system_metrics_interval_s=cfg.tracking.system_metrics_interval_s) as run:
        if tags:
            run.set_tags(tags)
        result = _train_into(run, spark, cfg, manifest, resume, initial_parameters, on_epoch, stoppable)
        evaluation = _evaluate_into(run, spark, cfg, manifest, result.spec, result.parameters)
        model_uri = _log_model(run, spark, cfg, manifest, result.spec, result.parameters)
        _record_model_uri(cfg, run.run_id, model_uri)
    from pipeline.etl.pinning import trained_on

    return TrackedTraining(PipelineOutcome(run.run_id, run.tracking_uri, evaluation.metrics, result.seconds,
                                           model_uri, trained_on(manifest)), result)


def plan(cfg: PipelineConfig, assumed: dict, overrides=()):
    """``shardline plan``: the strategy decision for ``cfg`` on an assumed cluster (``plan.Assumed``'s fields),
    without Spark or training; every strategy key the command line did not fix is open (launch/strategy/plan.py)."""
    from pipeline.config.loader import with_changes
    from pipeline.launch.strategy import decide
    from pipeline.launch.strategy.plan import Assumed, assumed_probes, open_keys
    from pipeline.launch.train import model_spec_of

    assumed = Assumed(**assumed)
    cfg = with_changes(cfg, **open_keys(overrides), parallelism={"data": assumed.hosts * assumed.ranks_per_host})
    manifest = spec = None
    if assumed.param_mb is None:
        try:
            manifest = load_shards(cfg)
        except (OSError, ShardlineError) as exc:
            raise ConfigError(f"shardline plan sizes the model on its shard set, and there is none for this config "
                              f"({exc}); run `shardline etl` first, or pass --param-mb (and --compute-ms)") from None
        spec = model_spec_of(cfg, manifest)
    return decide(cfg, assumed_probes(cfg, manifest, spec, assumed))


def registered_name(cfg: PipelineConfig) -> str:
    return cfg.tracking.registered_model or cfg.name


def champion_model(spark, cfg: PipelineConfig):
    """(ModelSpec, flat parameters, RegisteredVersion) of the current champion, or None."""
    import tempfile

    import torch

    from pipeline.models import ModelSpec
    from pipeline.tracking.registry import CHAMPION, alias_version, download

    uri = tracking_uri(cfg)
    champion = alias_version(uri, registered_name(cfg), CHAMPION)
    if champion is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = download(uri, champion.run_id, f"{MODEL_ARTIFACT_DIR}/model.pt", tmp)
        from pipeline.models.trust import allowed_factories, open_model

        state = open_model(torch.load(path, weights_only=True), allowed_factories(cfg.model),
                           f"the champion {registered_name(cfg)} (run {champion.run_id}) {MODEL_ARTIFACT_DIR}/model.pt")
    return ModelSpec.from_dict(state["spec"]), state["parameters"], champion


def promote(spark, cfg: PipelineConfig, manifest: Optional[Manifest] = None, run_id: Optional[str] = None,
            model_uri: Optional[str] = None) -> Promotion:
    """Register the model of `run_id` (default: the last trained one) and give it the alias `champion` if it
    beats the current champion on this shard set's test split by more than workflow.margin (both scored
    now, on the same rows); otherwise `challenger`, with the reason on the version and the run."""
    from pipeline.evaluate import evaluate as evaluate_model
    from pipeline.tracking import start_run
    from pipeline.tracking.registry import CHALLENGER, CHAMPION, register, set_alias

    manifest = manifest or load_shards(cfg)
    spec, parameters, saved_run = load_saved_model(cfg)
    run_id = run_id or saved_run
    if run_id is None:
        raise ShardlineError("no trained model to promote; run `shardline train` first")
    model_uri = model_uri or _saved_model_uri(cfg)
    if model_uri is None:
        raise ShardlineError(f"run {run_id} logged no MLflow model (tracking.log_model=false); nothing to register")
    w = cfg.workflow
    new = evaluate_model(spark, manifest, spec, parameters, "test").metrics[w.metric]
    champion = champion_model(spark, cfg)
    old = None
    if champion is None:
        alias, reason = CHAMPION, f"no champion yet; test {w.metric} {new:.4f}"
    else:
        try:
            old = evaluate_model(spark, manifest, champion[0], champion[1], "test").metrics[w.metric]
        except Exception as exc:  # e.g. the champion has another shape: it cannot compete on these rows
            alias, reason = CHAMPION, (f"the champion (version {champion[2].version}) cannot be scored on this "
                                       f"test data ({type(exc).__name__}: {exc}); test {w.metric} {new:.4f}")
        else:
            better = new > old + w.margin if w.higher_is_better else new < old - w.margin
            verb = "beats" if better else "does not beat"
            alias = CHAMPION if better else CHALLENGER
            reason = (f"test {w.metric} {new:.4f} {verb} the champion's (version {champion[2].version}) {old:.4f} "
                      f"by more than workflow.margin={w.margin:g} on the same {manifest.split('test').rows} rows")
    uri = tracking_uri(cfg)
    version = register(uri, model_uri, registered_name(cfg), run_id, tags={"shardline.fingerprint": manifest.fingerprint})
    set_alias(uri, version, alias, reason)
    with start_run(uri, cfg.tracking.experiment, run_id=run_id) as run:
        run.set_tags({"shardline.promotion": alias, "shardline.promotion_reason": reason,
                      "shardline.registered_version": version.version})
    log.info("promotion: %s version %s -> %s (%s)", version.name, version.version, alias, reason)
    return Promotion(alias, version.version, reason, new, old)


def _saved_model_uri(cfg: PipelineConfig) -> Optional[str]:
    return _last_run(cfg).get("model_uri")
