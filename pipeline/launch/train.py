"""Driver side: one training run — preflight, resume, the placement's attempts, the merged result.

The barrier stage runs through the DataFrame API (``mapInArrow(..., barrier=True)``), which is the same
barrier stage as ``rdd.barrier()`` but also works where a session has no SparkContext (Spark Connect).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from pipeline.config.schema import PipelineConfig
from pipeline.config.workdir import Workdir
from pipeline.errors import ConfigError
from pipeline.launch.attempts import run_attempts
from pipeline.launch.elastic import fit_workers, stream_plan
from pipeline.launch.hosts import check_shared_storage
from pipeline.launch.merge import check_steps, merged_model
from pipeline.launch.placement import TrainingRun, placement_for
from pipeline.launch.plans import consistency
from pipeline.launch.preflight import check_barrier_slots, check_result_size
from pipeline.launch.ps_side.progress import EpochProgress
from pipeline.launch.retry import RetryPolicy
from pipeline.launch.slot_check import ClusterShrank, SlotCheck
from pipeline.models import ModelSpec, build_model, flat_parameters, model_spec
from pipeline.shards import Manifest, steps_per_epoch

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    spec: ModelSpec
    # The merged model's flat state (pipeline.models.state): its fp32 parameters followed by its buffers'
    # words (BatchNorm running statistics, ...); just the parameters for a model without buffers.
    parameters: object
    history: list[dict]
    ranks: list[dict]
    steps: int
    seconds: float
    ps_stats: dict = field(default_factory=dict)
    # One entry per failed barrier attempt that was retried: attempt, root-cause ranks, error, step.
    failed_attempts: list[dict] = field(default_factory=list)
    resumed_from_step: Optional[int] = None
    # Set when the model is the best epoch's (early stop, divergence guard): launch.monitor.StopInfo fields.
    stopped: Optional[dict] = None

    def model(self):
        """The merged model: a fresh module holding the final parameters and buffers."""
        return merged_model(self.spec, self.parameters)


def train(spark, cfg: PipelineConfig, manifest: Manifest,
          on_epoch: Optional[Callable[[dict], Optional[str]]] = None, *, resume: bool = False,
          checkpoint_extra: Optional[dict] = None, initial_parameters=None, stoppable: bool = False,
          strategy=None) -> TrainResult:
    """Train on the shard set with ``cfg.parallelism.tasks`` barrier workers synchronized by a PS (on the
    driver or in rank 0's task, ``ps.placement``) or by allreduce.

    A failed barrier attempt is retried (up to train.max_attempts) when a retry can cure it; checkpoints
    go to train.checkpoint_dir. resume=True starts from the newest checkpoint there instead of from
    scratch. checkpoint_extra (plain values) is stored in every checkpoint. With ``stoppable``, an
    ``on_epoch`` that returns a reason (a str) stops training after that epoch, keeping the best epoch
    (``shardline tune``'s pruner): on the ps backend with the driver-hosted PS; elsewhere it is logged.
    ``strategy``: the ``choose_strategy`` decision that made ``cfg`` (its prediction is checked against the
    first epoch); with a config that still says auto somewhere, this call chooses.
    """
    import torch

    from pipeline.checkpoints import CheckpointMeta, CheckpointStore
    from pipeline.ps.state.sharded import merge_checkpoint_parts
    from pipeline.models.state import flat_buffers, join_state
    from pipeline.ps.modes.consistency import expected_version

    cfg = fit_workers(spark, cfg)  # train.min_workers: fewer slots than asked may still train
    if strategy is None:
        cfg, strategy = resolve_strategy(spark, cfg, manifest, resume=resume)
    check_shared_storage(spark, cfg, etl=False)
    replicas, stages = cfg.parallelism.data, cfg.parallelism.pipeline
    workers = cfg.parallelism.tasks  # barrier tasks: one per (replica, stage)
    check_barrier_slots(spark, workers, None if stages == 1 else
                        f"parallelism.data x pipeline = {replicas} x {stages} barrier tasks")
    steps = steps_per_epoch(manifest, replicas, cfg.train.batch_size, per_rank_shards=cfg.data.reader == "petastorm")
    spec = model_spec_of(cfg, manifest)
    store = CheckpointStore(Workdir.of(cfg).checkpoints, cfg.train.keep_checkpoints,
                            merge_parts=merge_checkpoint_parts)  # ps.placement=hosts: sets of shard parts
    allreduce = cfg.train.backend == "allreduce"
    resumed = latest = None
    if resume:
        resumed, latest = _resume_state(cfg, store, manifest, spec)
    else:
        moved = store.archive_previous()
        if moved:
            log.info("moved %d checkpoint(s) of an earlier run to %s/previous (start with --resume to continue "
                     "that run instead)", moved, store.directory)
    torch.manual_seed(cfg.train.seed)  # every worker starts from the server's copy of this initialization
    initial_model = build_model(spec)
    initial, initial_buffers = flat_parameters(initial_model), flat_buffers(initial_model)
    _check_sparse(cfg, initial_model)
    if allreduce or cfg.ps.placement == "task":
        check_result_size(spark, initial.numel() * 4, "with train.backend=allreduce" if allreduce
                          else "with ps.placement=task")
    if initial_parameters is not None:  # a warm start (e.g. from the champion): its parameters [+ buffers]
        warm = initial_parameters.detach().to(torch.float32).reshape(-1).clone()
        if warm.numel() not in (initial.numel(), initial.numel() + initial_buffers.numel()):
            raise ConfigError(f"warm-start parameters have {warm.numel()} values, the model "
                              f"{initial.numel()}; the model.* settings changed: disable workflow.warm_start")
        initial = warm[:initial.numel()].clone()
        if warm.numel() > initial.numel():
            initial_buffers = warm[initial.numel():].clone()
    stream = stream_plan(cfg, manifest, steps, resumed)  # a resume may change the world size (elastic.py)
    expected = expected_version(consistency(cfg), stream.total_steps(cfg.train.epochs), replicas)
    placement = None
    history_checked: list = []

    def epoch_done(row: dict) -> None:
        placement.on_epoch(row)
        # the first epoch after the warm-up one (its first steps pay first-call allocations and imports)
        if strategy is not None and not history_checked and int(row["epoch"]) >= min(1, cfg.train.epochs - 1):
            history_checked.append(row)
            _check_prediction(strategy, row, steps, cfg.train.auto.warn_factor)
        reason = on_epoch(row) if on_epoch is not None else None
        if stoppable and isinstance(reason, str):
            placement.request_stop("pruned", reason, int(row["epoch"]))

    run = TrainingRun(spark=spark, cfg=cfg, manifest=manifest, spec=spec, steps_per_epoch=steps, initial=initial,
                      initial_buffers=initial_buffers,
                      expected_version=expected, store=store, progress=EpochProgress(workers, cfg.train.epochs, epoch_done),
                      resumed=resumed, resumed_from=latest, warm_started=initial_parameters is not None,
                      stoppable=stoppable and not allreduce,
                      checkpoint_meta=CheckpointMeta(fingerprint=manifest.fingerprint, model=spec.to_dict(),
                                                     world_size=replicas, mode=cfg.ps.mode, steps_per_epoch=steps,
                                                     epochs=cfg.train.epochs, seed=cfg.train.seed,
                                                     extra=dict(checkpoint_extra or {}), stream=stream.record()),
                      stream=stream)
    placement = placement_for(run)
    policy = RetryPolicy(cfg.train.max_attempts)
    slots = SlotCheck(spark, workers, cfg.train.min_workers, cfg.timeouts.slots_s)
    started = time.perf_counter()
    try:
        with placement:
            rows, failed_attempts = run_attempts(placement, policy, slots)
            outcome = placement.outcome(rows)
            if getattr(placement, "keeps_sparse_tables", False):  # ps.sparse: the trained rows next to the model
                from pipeline.launch.sparse_tables import with_trained_tables

                spec = with_trained_tables(cfg, spec, placement.server)
    except ClusterShrank as shrink:  # the PS is closed by now: the smaller run starts its own
        return _go_on_smaller(spark, cfg, manifest, shrink, on_epoch=on_epoch, checkpoint_extra=checkpoint_extra,
                              initial_parameters=initial_parameters, stoppable=stoppable)
    seconds = time.perf_counter() - started
    check_steps(outcome.version, outcome.expected)
    ranks = sorted(({k: v for k, v in r.items() if k not in ("parameters", "buffers")} for r in outcome.rows),
                   key=lambda r: r["rank"])
    log.info("training done: %d steps in %.1fs; ranks ran in %s", outcome.version, seconds,
             ", ".join(f"{r['rank']}@{r['process']} ({r['device']}{', gpu ' + r['gpu'] if r['gpu'] else ''})"
                       for r in ranks))
    for r in ranks:
        log.info("rank %d imported pipeline from %s", r["rank"], r.get("package"))
    return TrainResult(spec=spec, parameters=join_state(outcome.parameters, outcome.buffers),
                       history=run.progress.history, ranks=ranks,
                       steps=outcome.version, seconds=seconds, ps_stats=outcome.stats, failed_attempts=failed_attempts,
                       resumed_from_step=None if resumed is None else int(resumed["step"]),
                       stopped=outcome.stopped)


def _go_on_smaller(spark, cfg: PipelineConfig, manifest: Manifest, shrink: ClusterShrank, **kwargs) -> TrainResult:
    """train.min_workers after hosts left mid-run: the same run on the slots that are left, from the
    newest checkpoint (the PS saved one after the failed attempt) as an elastic resume (elastic.py) with
    exact step accounting; allreduce keeps no state outside its replicas, so it starts over."""
    from pipeline.config.loader import with_changes

    stateful = cfg.train.backend != "allreduce"
    log.warning("ELASTIC RETRY: %s; training goes on with %d workers from %s", shrink, shrink.slots,
                "the newest checkpoint" if stateful else "the start (allreduce keeps no server state)")
    result = train(spark, with_changes(cfg, parallelism={"data": shrink.slots}), manifest, resume=stateful, **kwargs)
    result.failed_attempts = list(getattr(shrink, "failed_attempts", [])) + result.failed_attempts
    return result


def resolve_strategy(spark, cfg: PipelineConfig, manifest: Manifest, *, resume: bool = False):
    """(the config to train with, the strategy decision or None): ``train.backend`` / ``ps.*`` auto keys
    decided by the measured cost model (pipeline/launch/strategy/); a config without auto is returned as is.
    ``resume``: what the checkpoint fixed stays fixed: the PS (allreduce keeps no server state) and its mode."""
    from pipeline.config.loader import with_changes
    from pipeline.launch.strategy import choose_strategy, has_auto

    if not has_auto(cfg):
        return cfg, None
    if resume:
        from pipeline.checkpoints import CheckpointStore

        store = CheckpointStore(Workdir.of(cfg).checkpoints, cfg.train.keep_checkpoints)
        latest = store.latest()
        mode = store.load(latest, parts=False).get("mode") if latest is not None else None
        cfg = with_changes(cfg, train={"backend": "ps" if cfg.train.backend == "auto" else cfg.train.backend},
                           ps={"mode": mode if cfg.ps.mode == "auto" and mode else cfg.ps.mode})
    return choose_strategy(spark, cfg, manifest, model_spec_of(cfg, manifest), cfg.parallelism.tasks)


def model_spec_of(cfg: PipelineConfig, manifest: Manifest) -> ModelSpec:
    """The model spec of ``cfg`` on ``manifest``'s features (what the workers build)."""
    return model_spec(cfg.model, features=manifest.feature_set, num_classes=manifest.num_classes,
                      task=manifest.task, labels=manifest.label_mapping, target_scale=_target_scale(cfg, manifest),
                      sparse=cfg.ps.sparse.model_options(cfg.train.seed))


def _check_prediction(strategy, row: dict, steps: int, factor: float) -> None:
    """After the first epoch past the warm-up one (the only one of a 1-epoch run): the measured step (the
    slowest rank's own clock) against auto's prediction."""
    measured = [v for k, v in row.items() if k.endswith("/step_time_s")]
    step_s = max(measured) if measured else float(row.get("epoch_seconds", 0.0)) / max(steps, 1)
    warning = strategy.check_first_epoch(step_s, factor)
    if warning:
        log.warning(warning)
    else:
        log.info("train.backend=auto: the first epoch's step %.2f ms against %.2f ms predicted for %s",
                 step_s * 1e3, strategy.predicted.step_s * 1e3, strategy.pick.name)


def _check_sparse(cfg: PipelineConfig, model) -> None:
    from pipeline.models.sparse_embedding import sparse_modules

    if sparse_modules(model):
        from pipeline.launch.sparse_tables import check_supported

        check_supported(cfg)


def _target_scale(cfg: PipelineConfig, manifest: Manifest) -> Optional[tuple[float, float]]:
    """Regression with model.standardize_target: the train split's (mean, std) of the target."""
    if manifest.task != "regression" or not cfg.model.standardize_target:
        return None
    from pipeline.shards.target_stats import target_moments

    return target_moments(manifest)


def _resume_state(cfg: PipelineConfig, store, manifest: Manifest, spec: ModelSpec):
    """--resume: (state, CheckpointInfo) of the newest checkpoint, checked against this run's layout."""
    from pipeline.checkpoints import check_compatible

    if cfg.train.backend == "allreduce":
        raise ConfigError("--resume needs train.backend=ps: with allreduce the state lives only in the workers' "
                          "replicas, so there is no server state to checkpoint")
    latest = store.latest()
    if latest is None:
        raise ConfigError(f"--resume: no checkpoint in {store.directory} (train.checkpoint_dir); "
                          "start without --resume")
    resumed = store.load(latest)
    from pipeline.models.trust import allowed_factories, check_factory

    check_factory(resumed.get("model") or {}, allowed_factories(cfg.model), f"--resume: checkpoint {latest.path}")
    check_compatible(resumed, latest.path, fingerprint=manifest.fingerprint, model=spec.to_dict(), mode=cfg.ps.mode)
    saved_stages = len(resumed["ps"].get("stages", [None]))
    if saved_stages != cfg.parallelism.pipeline:
        raise ConfigError(f"cannot resume from checkpoint {latest.path}: it was trained with "
                          f"parallelism.pipeline={saved_stages}, the config says {cfg.parallelism.pipeline} (use the "
                          "same parallelism.pipeline and cuts, or start fresh)")
    return resumed, latest
