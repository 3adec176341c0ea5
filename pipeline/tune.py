"""``shardline tune``: an Optuna search over ``tune.space``, each trial a shardline training run.

One ETL for the study (the space holds only model/train/ps/parallelism keys), then trials one after
another — each is a barrier job that takes the cluster's slots — every trial an MLflow run nested under
the study's parent run (params, per-epoch metrics, test metrics, its model). Each epoch's ``tune.metric``
is reported to Optuna live; when the pruner says so the trial stops after that epoch (its best epoch is
kept, as early stopping keeps it) and is recorded as pruned. The study lives in Optuna's storage (SQLite
under the workdir by default) and remembers its parent run, so rerunning the same command after an
interruption resumes: finished and pruned trials count, and only the rest run.

At the end the best trial's full config is written to ``<workdir>/tune/<study>/best.yaml``, logged to
the parent run, and the best trial's model is registered (``tracking.registered_model``, else
``<name>-tuned``) with the study's tags.

Why Optuna and not our own search: its samplers (TPE), pruners, storage and resumption are the
well-kept version of everything here; shardline adds only the trial = training-run glue.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipeline.config.loader import build, deep_merge, nested
from pipeline.config.schema import PipelineConfig
from pipeline.config.tune import SearchChoices, SearchRange
from pipeline.config.workdir import Workdir
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class TuneOutcome:
    study: str
    storage: str
    parent_run_id: str
    trials: int  # finished + pruned trials in the study now
    pruned: int
    best_value: float
    best_params: dict[str, Any]
    best_run_id: str
    best_config: str  # the path of best.yaml
    model_version: Optional[str]


def trial_config(cfg: PipelineConfig, params: dict[str, Any]) -> PipelineConfig:
    """The study's config with one trial's values; a bad key or value is a ConfigError naming it."""
    merged = cfg.model_dump(mode="json")
    for key, value in params.items():
        merged = deep_merge(merged, nested(key, value))
    return build(merged, f"tune trial {json.dumps(params, default=str)}")


def _suggest(trial, key: str, spec) -> Any:
    if isinstance(spec, SearchChoices):
        # Optuna stores categorical choices as they are only for None/bool/int/float/str: lists (model.hidden)
        # go through as their JSON text and come back decoded.
        plain = all(v is None or isinstance(v, (bool, int, float, str)) for v in spec.choices)
        if plain:
            return trial.suggest_categorical(key, spec.choices)
        return json.loads(trial.suggest_categorical(key, [json.dumps(v) for v in spec.choices]))
    assert isinstance(spec, SearchRange)
    if spec.integer:
        return trial.suggest_int(key, int(spec.low), int(spec.high), step=int(spec.step or 1), log=spec.log)
    return trial.suggest_float(key, float(spec.low), float(spec.high), step=spec.step, log=spec.log)


def _check_space(cfg: PipelineConfig) -> None:
    """Build the config at each end of every range and with every choice, before any trial runs."""
    space = cfg.tune.space
    if not space:
        raise ConfigError("tune.space is empty: give at least one key to search, e.g. "
                          "tune.space={train.lr: {low: 0.001, high: 0.3, log: true}}")
    for key, spec in space.items():
        values = spec.choices if isinstance(spec, SearchChoices) else [spec.low, spec.high]
        for value in values:
            try:
                trial_config(cfg, {key: value})
            except ConfigError as exc:
                raise ConfigError(f"tune.space {key!r}: the value {value!r} gives an invalid config: {exc}") from None


def study_storage(cfg: PipelineConfig) -> tuple[str, str]:
    """(study name, Optuna storage URL)."""
    name = cfg.tune.study or f"{cfg.name}-tune"
    if cfg.tune.storage:
        return name, cfg.tune.storage
    root = Path(Workdir.of(cfg).path).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return name, f"sqlite:///{root / 'optuna.db'}"


def tune(spark, cfg: PipelineConfig, trials: Optional[int] = None) -> TuneOutcome:
    import optuna

    from pipeline import steps
    from pipeline.tracking import start_run

    _check_space(cfg)
    wanted = trials if trials is not None else cfg.tune.trials
    if wanted < 1:
        raise ConfigError(f"--trials must be at least 1 (got {wanted})")
    name, storage = study_storage(cfg)
    seed = cfg.tune.seed if cfg.tune.seed is not None else cfg.train.seed
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=cfg.tune.startup_trials) if cfg.tune.pruner == "median"
              else optuna.pruners.NopPruner())
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                direction="maximize" if cfg.tune.maximize else "minimize",
                                sampler=optuna.samplers.TPESampler(seed=seed), pruner=pruner)
    done = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    manifest = steps.etl(spark, cfg)
    parent_id = study.user_attrs.get("mlflow_parent_run_id")
    with start_run(steps.tracking_uri(cfg), cfg.tracking.experiment, f"tune-{name}", run_id=parent_id,
                   tags={"shardline.tune.study": name}) as parent:
        study.set_user_attr("mlflow_parent_run_id", parent.run_id)
        if parent_id is None:
            parent.log_params({"tune.study": name, "tune.metric": cfg.tune.metric, "tune.trials": wanted,
                               "tune.space": json.dumps({k: v.model_dump() for k, v in cfg.tune.space.items()})})
        remaining = max(wanted - len(done), 0)
        if done:
            log.info("study %s at %s: %d trial(s) already done, %d to run", name, storage, len(done), remaining)
        study.optimize(lambda trial: _objective(trial, spark, cfg, manifest, name), n_trials=remaining,
                       catch=())
        return _finish(study, cfg, parent, name, storage)


def _objective(trial, spark, cfg: PipelineConfig, manifest, study: str) -> float:
    import optuna

    from pipeline import steps

    params = {key: _suggest(trial, key, spec) for key, spec in cfg.tune.space.items()}
    trial_cfg = trial_config(cfg, params)
    metric = cfg.tune.metric
    seen: list[float] = []

    def on_epoch(row: dict) -> Optional[str]:
        value = row.get(metric)
        if value is None:
            return None
        seen.append(float(value))
        trial.report(float(value), step=int(row["epoch"]))
        if trial.should_prune():
            return f"Optuna's {cfg.tune.pruner} pruner stopped trial {trial.number} at epoch {int(row['epoch']) + 1}"
        return None

    log.info("trial %d: %s", trial.number, json.dumps(params, default=str))
    tracked = steps.tracked_training(spark, trial_cfg, manifest, on_epoch=on_epoch, stoppable=True,
                                     tags={"shardline.tune.study": study, "shardline.tune.trial": str(trial.number)})
    trial.set_user_attr("mlflow_run_id", tracked.outcome.run_id)
    trial.set_user_attr("model_uri", tracked.outcome.model_uri)
    trial.set_user_attr("params", json.dumps(params, default=str))
    if not seen:
        raise ConfigError(f"tune.metric={metric!r} is not in the epoch rows (keys "
                          f"{sorted(k for k in (tracked.result.history[-1] if tracked.result.history else {}) if '/' not in k)}); "
                          "use val_accuracy or val_loss (they need a validation split), or train_loss")
    stopped = tracked.result.stopped or {}
    if stopped.get("kind") == "pruned":
        raise optuna.TrialPruned(stopped.get("reason", "pruned"))
    # The trial's model is its best epoch's when early stopping kept one, else the last epoch's.
    return float(stopped["best_value"]) if stopped.get("best_value") is not None else seen[-1]


def _finish(study, cfg: PipelineConfig, parent, name: str, storage: str) -> TuneOutcome:
    import optuna
    import yaml

    from pipeline import steps
    from pipeline.tracking.registry import register

    finished = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    if not finished:
        raise ConfigError(f"study {name}: no trial finished ({len(pruned)} pruned); raise tune.trials or "
                          "tune.startup_trials, or set tune.pruner=none")
    best = study.best_trial
    params = json.loads(best.user_attrs["params"])
    best_cfg = trial_config(cfg, params)
    folder = Path(Workdir.of(cfg).path).resolve() / "tune" / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "best.yaml"
    temporary = path.with_suffix(".yaml.tmp")
    temporary.write_text(yaml.safe_dump(best_cfg.model_dump(mode="json"), sort_keys=False))
    temporary.replace(path)  # whole or not at all
    parent.log_file(path, "tune")
    parent.log_metrics({f"best_{cfg.tune.metric}": float(best.value), "trials_complete": len(finished),
                        "trials_pruned": len(pruned)})
    parent.set_tags({"shardline.tune.best_trial": str(best.number),
                     "shardline.tune.best_run_id": best.user_attrs["mlflow_run_id"]})
    version = None
    if best.user_attrs.get("model_uri"):  # tracking.log_model=false: nothing to register
        version = register(steps.tracking_uri(cfg), best.user_attrs["model_uri"],
                           cfg.tracking.registered_model or f"{cfg.name}-tuned", best.user_attrs["mlflow_run_id"],
                           tags={"shardline.tune.study": name, "shardline.tune.trial": str(best.number)}).version
    log.info("study %s: best trial %d, %s=%.6g, params %s; config %s", name, best.number, cfg.tune.metric,
             best.value, params, path)
    return TuneOutcome(name, storage, parent.run_id, len(finished) + len(pruned), len(pruned), float(best.value),
                       params, best.user_attrs["mlflow_run_id"], str(path), version)
