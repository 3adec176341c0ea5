"""Driver side: the validated config turned, once, into the typed plans each part is handed whole —
a ``WorkerPlan`` per barrier task, the PS's ``PSSettings``, the waits' ``Deadlines``."""
from __future__ import annotations

from typing import Optional

from pipeline.config.schema import PipelineConfig
from pipeline.models import ModelSpec
from pipeline.shards import Manifest, rank_files
from pipeline.wire.deadline import CONNECT_KEY, DEFAULT_KEY, LINK_KEY, STEP_KEY, Timeout
from pipeline.worker.plan import Deadlines, FaultPlan, LoaderPlan, StagePlan, WorkerPlan

# allreduce peers blocked in a collective cannot hear the PS abort: a failed attempt is cancelled after
# this much grace instead of waiting out their collective timeout.
ALLREDUCE_GRACE_S = 3.0


def _timeout(value: Optional[float], key: str, default: float) -> Timeout:
    return Timeout(value, key) if value is not None else Timeout(default, key, DEFAULT_KEY)


def deadlines(cfg: PipelineConfig) -> Deadlines:
    t, default = cfg.timeouts, cfg.ps.timeout_s
    return Deadlines(step=_timeout(t.step_s, STEP_KEY, default), connect=_timeout(t.connect_s, CONNECT_KEY, default),
                     link=_timeout(t.link_s, LINK_KEY, default))


def failed_attempt_grace(cfg: PipelineConfig) -> Timeout:
    """How long a failed attempt's tasks may take to stop before the stage is cancelled."""
    step = deadlines(cfg).step
    return step.shorter(ALLREDUCE_GRACE_S) if cfg.train.backend == "allreduce" else step


def optimizer_spec(cfg: PipelineConfig, steps_per_epoch: int = 1, *, server: bool = False, offset: int = 0):
    """The optimizer of the server (``server``: its schedule counts versions) or of a worker's local
    optimizer (average, allreduce: its schedule counts the rank's own steps). ``offset``: the run's step
    offset after a resume on another world size (StreamPlan), so the schedule ends with the run."""
    from pipeline.ps import OptimizerSpec
    from pipeline.ps.modes.consistency import expected_version
    from pipeline.ps.modes.schedule import schedule_spec

    t = cfg.train
    total = offset + steps_per_epoch * t.epochs
    if server:
        total = expected_version(consistency(cfg), total, cfg.parallelism.data)
    return OptimizerSpec(name=t.optimizer, lr=t.lr, momentum=t.momentum if t.optimizer == "sgd" else 0.0,
                         weight_decay=t.weight_decay, schedule=schedule_spec(cfg, total),
                         clip_grad_norm=t.clip_grad_norm)


def consistency(cfg: PipelineConfig):
    from pipeline.ps.modes.consistency import Consistency

    return Consistency(mode=cfg.ps.mode, staleness=cfg.ps.staleness, sync_every=cfg.ps.sync_every,
                       staleness_scale=cfg.ps.staleness_scale)


def ps_settings(cfg: PipelineConfig, steps_per_epoch: int = 1, offset: int = 0, *, local_workers: bool = False):
    """The server's settings from ``cfg``; ``local_workers``: the workers share this host's cores (a local
    master), which sets ps.server_threads' default."""
    from pipeline.ps import PSSettings

    from pipeline.ps.modes.staleness import server_optimizer

    # async/ssp: the server's momentum net of what asynchrony implies (ps.async_momentum).
    optimizer = server_optimizer(optimizer_spec(cfg, steps_per_epoch, server=True, offset=offset), cfg.ps.mode,
                                 cfg.parallelism.data, cfg.ps.staleness, cfg.ps.async_momentum)
    return PSSettings(optimizer=optimizer, consistency=consistency(cfg), compression=cfg.ps.compression,
                      topk_ratio=cfg.ps.topk_ratio, shards=cfg.ps.shards, step_timeout=deadlines(cfg).step,
                      bucket_bytes=bucket_bytes(cfg), server_processes=cfg.ps.server_processes,
                      shared_memory_bytes=int(cfg.ps.shared_memory_mb * (1 << 20)),
                      # ps.placement=hosts: each shard shares its host with that host's ranks, as a local
                      # master's PS shares the driver's cores with its workers
                      server_threads=(1 if local_workers or cfg.ps.placement == "hosts" else 0)
                      if cfg.ps.server_threads is None else cfg.ps.server_threads)


def bucket_bytes(cfg: PipelineConfig) -> int:
    """ps.overlap: the server's slices are the gradient buckets workers push during backward. Off (0)
    where a step needs the whole gradient in one place (train.clip_grad_norm's global norm) or with
    pipeline stages (each stage's server keeps ps.shards); an explicit ps.shards > 1 wins over it
    (``PSSettings.shards_for``)."""
    if not cfg.ps.overlap or cfg.train.clip_grad_norm is not None or cfg.parallelism.pipeline > 1:
        return 0
    return max(4, int(cfg.ps.bucket_mb * (1 << 20)))


def fault_plan(cfg: PipelineConfig, attempt: int) -> FaultPlan:
    """The faults.* hooks, in the first faults.attempts attempts only (so a retry can succeed)."""
    f = cfg.faults
    if attempt > f.attempts:
        return FaultPlan(record_dir=f.record_rows_dir)
    return FaultPlan(fail_rank=f.fail_rank, fail_step=f.fail_step, fail_in_rendezvous=f.fail_in_rendezvous,
                     kill_rank=f.kill_rank, kill_step=f.kill_step, delay_rank=f.delay_rank, delay_ms=f.delay_ms,
                     delay_step=f.delay_step, explode_rank=f.explode_rank, explode_step=f.explode_step,
                     explode_factor=f.explode_factor, record_dir=f.record_rows_dir)


def worker_plans(cfg: PipelineConfig, manifest: Manifest, spec: ModelSpec, steps: int, generation: int,
                 attempt: int, stage_addresses: Optional[list] = None, stream=None) -> list[WorkerPlan]:
    """One plan per barrier task (rank = replica * stages + stage). ``stream`` (a StreamPlan; None: a fresh
    run's) places a resumed run's steps in its epochs.

    The arrow reader gets every train file and reads replica r's part of each epoch's row stream; the
    petastorm reader gets shard r's files (its old per-rank assignment)."""
    from pipeline.data.assignment import StreamPlan
    from pipeline.worker.validation import part_rows

    stream = stream or StreamPlan(manifest.split("train").rows, cfg.parallelism.data, steps)
    per_rank = cfg.data.reader == "petastorm"
    everything = tuple(manifest.files("train"))
    all_groups = tuple(tuple(r) for r in manifest.row_group_rows("train"))
    validation_total = manifest.split("validation").rows if "validation" in manifest.splits else 0
    validation = tuple(manifest.files("validation")) if validation_total > 0 else ()
    stages, faults, waits = cfg.parallelism.pipeline, fault_plan(cfg, attempt), deadlines(cfg)
    optimizer = optimizer_spec(cfg, steps, offset=stream.offset)
    cuts = tuple(cfg.parallelism.cuts) if cfg.parallelism.cuts else None

    def plan(rank: int) -> WorkerPlan:
        replica, stage = divmod(rank, stages)  # the replica's shard is what this task reads
        loader = LoaderPlan(reader=cfg.data.reader, shuffle=cfg.data.shuffle,
                            shuffle_buffer_rows=cfg.data.shuffle_buffer_rows, reader_threads=cfg.data.reader_threads,
                            prefetch=cfg.train.prefetch,
                            row_group_rows=(tuple(tuple(r) for r in manifest.row_group_rows("train", replica))
                                            if per_rank else all_groups),
                            world=None if per_rank else cfg.parallelism.data, resumed=stream.resumed)
        grid = None
        if stages > 1:
            grid = StagePlan(stage=stage, stages=stages, replica=replica, replicas=cfg.parallelism.data,
                             micro_batches=cfg.parallelism.micro_batches, cuts=cuts,
                             ps=tuple(stage_addresses[stage]) if stage_addresses else None)
        # Every replica evaluates its part of the validation split (pipeline.worker.validation); with
        # pipeline stages no task holds the whole model, so none does.
        part = part_rows(validation_total, replica, cfg.parallelism.data)
        evaluates = stages == 1 and part[0] < part[1]
        return WorkerPlan(
            rank=rank, world_size=cfg.parallelism.tasks, generation=generation,
            # Only the first stage reads features and only the last labels; middle stages read nothing.
            train_files=((tuple(rank_files(manifest, replica)) if per_rank else everything)
                         if stage in (0, stages - 1) else ()),
            validation_files=validation if evaluates else (), validation_rows=part if evaluates else None,
            validation_cache_mb=cfg.data.validation_cache_mb,
            model=spec, features_field=manifest.features_field, label_field=manifest.label_field,
            epochs=cfg.train.epochs, steps_per_epoch=steps, seed=cfg.train.seed, loader=loader, faults=faults,
            optimizer=optimizer, backend=cfg.train.backend, stage=grid, deadlines=waits,
            precision=cfg.train.precision, profile=cfg.train.profile, overlap=cfg.ps.overlap,
            allreduce_shared_memory=cfg.train.allreduce_shared_memory, step_offset=stream.offset)

    return [plan(rank) for rank in range(cfg.parallelism.tasks)]
