"""Driver-side orchestration of one training run: preflight, PS, barrier stage, results, teardown.

This module (with task.py) is the only place that touches BarrierTaskContext. The barrier stage runs
through the DataFrame API (`mapInArrow(..., barrier=True)`), which is the same barrier stage as
`rdd.barrier()` but also works where a session has no SparkContext (Spark Connect).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from pipeline.config.schema import PipelineConfig
from pipeline.errors import ConfigError, PSError, WorkerFailure, WorkerTrainingFailedError
from pipeline.launch.preflight import check_barrier_slots, check_result_size
from pipeline.launch.progress import EpochProgress, StepProgress
from pipeline.launch.snapshot import SnapshotNotReady, epochs_left_unreported, take_snapshot
from pipeline.launch.task import RESULT_SCHEMA, make_task_fn, merge_chunks
from pipeline.launch.task_ps import decode_failure_report
from pipeline.launch.watchdog import StageWatchdog
from pipeline.models import ModelSpec, build_model, flat_parameters, model_spec
from pipeline.shards import Manifest, rank_files, steps_per_epoch
from pipeline.worker import WorkerPlan

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    spec: ModelSpec
    parameters: object  # flat fp32 torch.Tensor: the PS's final parameters
    history: list[dict]
    ranks: list[dict]
    steps: int
    seconds: float
    ps_stats: dict = field(default_factory=dict)
    # One entry per failed barrier attempt that was retried: attempt, root-cause ranks, error, step.
    failed_attempts: list[dict] = field(default_factory=list)
    resumed_from_step: Optional[int] = None

    def model(self):
        """The merged model: a fresh module holding the PS's final parameters."""
        from pipeline.models import load_flat_parameters

        model = build_model(self.spec)
        load_flat_parameters(model, self.parameters)
        model.eval()
        return model


def _ps_host(spark, cfg: PipelineConfig) -> str:
    if cfg.ps.host:
        return cfg.ps.host
    try:
        return spark.conf.get("spark.driver.host")
    except Exception:
        import socket

        return socket.gethostbyname(socket.gethostname())


def _plans(cfg: PipelineConfig, manifest: Manifest, spec: ModelSpec, steps: int, generation: int,
           attempt: int, stage_addresses: Optional[list] = None) -> list[dict]:
    has_validation = "validation" in manifest.splits and manifest.split("validation").rows > 0
    validation = tuple(manifest.files("validation")) if has_validation else ()
    faults = cfg.faults.model_dump(exclude={"attempts"}) if attempt <= cfg.faults.attempts else {}

    stages = cfg.parallelism.pipeline

    def extra(rank: int) -> dict:
        replica = rank // stages  # the shard this task's replica reads
        loader = {"row_group_rows": manifest.row_group_rows("train", replica), "reader": cfg.data.reader,
                  "shuffle": cfg.data.shuffle, "shuffle_buffer_rows": cfg.data.shuffle_buffer_rows,
                  "reader_threads": cfg.data.reader_threads}
        out = {"faults": faults, "loader": loader}
        if stages > 1:
            out["pipeline"] = {"stage": rank % stages, "stages": stages, "replica": replica,
                               "replicas": cfg.parallelism.data, "micro_batches": cfg.parallelism.micro_batches,
                               "cuts": cfg.parallelism.cuts,
                               "ps": list(stage_addresses[rank % stages]) if stage_addresses else None}
        return out

    def files(rank: int) -> tuple:
        stage = rank % stages
        return tuple(rank_files(manifest, rank // stages)) if stage in (0, stages - 1) else ()

    return [
        WorkerPlan(
            rank=rank, world_size=cfg.parallelism.tasks, generation=generation,
            train_files=files(rank),
            # Validation needs the whole model in one task: only without pipeline stages.
            validation_files=validation if rank == 0 and stages == 1 else (),
            model=spec.to_dict(), task=manifest.task, num_features=manifest.num_features,
            features_field=manifest.features_field, label_field=manifest.label_field, epochs=cfg.train.epochs,
            steps_per_epoch=steps, seed=cfg.train.seed, prefetch=cfg.train.prefetch,
            ps_timeout_s=cfg.ps.timeout_s, extra=extra(rank), optimizer=dataclasses.asdict(_optimizer(cfg)),
            backend=cfg.train.backend,
        ).to_dict()
        for rank in range(cfg.parallelism.tasks)
    ]


def stage_ranges(spec: ModelSpec, cfg: PipelineConfig) -> list[tuple[int, int]]:
    """Each pipeline stage's [start, end) slice of the flat parameter vector."""
    from pipeline.parallel.stages import stage_slices
    from pipeline.worker.stage_loop import model_stages

    return stage_slices(model_stages(build_model(spec), cfg.parallelism.pipeline, cfg.parallelism.cuts))


def _optimizer(cfg: PipelineConfig):
    from pipeline.ps import OptimizerSpec

    t = cfg.train
    return OptimizerSpec(name=t.optimizer, lr=t.lr, momentum=t.momentum if t.optimizer == "sgd" else 0.0,
                         weight_decay=t.weight_decay)


def _consistency(cfg: PipelineConfig):
    from pipeline.ps.modes import Consistency

    return Consistency(mode=cfg.ps.mode, staleness=cfg.ps.staleness, sync_every=cfg.ps.sync_every)


def _spark_error_summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return " ".join(text[:3])[:1000] if text else type(exc).__name__


def checkpoint_dir(cfg: PipelineConfig) -> str:
    import os

    return cfg.train.checkpoint_dir or os.path.join(os.path.abspath(cfg.workdir), "checkpoints", cfg.name)


def train(spark, cfg: PipelineConfig, manifest: Manifest,
          on_epoch: Optional[Callable[[dict], None]] = None, *, resume: bool = False,
          checkpoint_extra: Optional[dict] = None, initial_parameters=None) -> TrainResult:
    """Train on the shard set with `cfg.parallelism.data` barrier workers synchronized by a driver PS.

    A failed barrier attempt is retried (up to train.max_attempts) against the same PS, whose state
    survives; checkpoints go to train.checkpoint_dir. resume=True starts from the newest checkpoint
    there instead of from scratch. checkpoint_extra (plain values) is stored in every checkpoint.
    """
    import torch

    from pipeline.checkpoints import CheckpointStore, check_compatible
    from pipeline.ps import ParameterServer, new_secret
    from pipeline.ps.modes import expected_version

    replicas, stages = cfg.parallelism.data, cfg.parallelism.pipeline
    workers = cfg.parallelism.tasks  # barrier tasks: one per (replica, stage)
    check_barrier_slots(spark, workers, None if stages == 1 else
                        f"parallelism.data x pipeline = {replicas} x {stages} barrier tasks")
    steps = steps_per_epoch(manifest, replicas, cfg.train.batch_size)
    spec = model_spec(cfg.model, num_features=manifest.num_features, num_classes=manifest.num_classes,
                      task=manifest.task)
    store = CheckpointStore(checkpoint_dir(cfg), cfg.train.keep_checkpoints)
    resumed = None
    allreduce = cfg.train.backend == "allreduce"
    if resume and allreduce:
        raise ConfigError("--resume needs train.backend=ps: with allreduce the state lives only in the workers' "
                          "replicas, so there is no server state to checkpoint")
    if not resume:
        moved = store.archive_previous()
        if moved:
            log.info("moved %d checkpoint(s) of an earlier run to %s/previous (start with --resume to continue "
                     "that run instead)", moved, store.directory)
    if resume:
        latest = store.latest()
        if latest is None:
            raise ConfigError(f"--resume: no checkpoint in {store.directory} (train.checkpoint_dir); "
                              "start without --resume")
        resumed = store.load(latest)
        check_compatible(resumed, latest.path, fingerprint=manifest.fingerprint, model=spec.to_dict(),
                         world_size=replicas, mode=cfg.ps.mode, steps_per_epoch=steps)
        saved_stages = len(resumed["ps"].get("stages", [None]))
        if saved_stages != stages:
            raise ConfigError(f"cannot resume from checkpoint {latest.path}: it was trained with "
                              f"parallelism.pipeline={saved_stages}, the config says {stages} (use the same "
                              "parallelism.pipeline and cuts, or start fresh)")
    torch.manual_seed(cfg.train.seed)  # every worker starts from the server's copy of this initialization
    initial = flat_parameters(build_model(spec))
    if allreduce or cfg.ps.placement == "task":
        check_result_size(spark, initial.numel() * 4, "with train.backend=allreduce" if allreduce
                          else "with ps.placement=task")
    if initial_parameters is not None:  # a warm start (e.g. from the champion)
        if initial_parameters.numel() != initial.numel():
            raise ConfigError(f"warm-start parameters have {initial_parameters.numel()} values, the model "
                              f"{initial.numel()}; the model.* settings changed: disable workflow.warm_start")
        initial = initial_parameters.detach().to(torch.float32).reshape(-1).clone()
    consistency = _consistency(cfg)
    expected = expected_version(consistency, steps * cfg.train.epochs, replicas)
    bar = StepProgress(lambda: server.version, expected)

    def epoch_done(row: dict) -> None:
        bar.update_loss(row)
        if on_epoch is not None:
            on_epoch(row)

    progress = EpochProgress(workers, cfg.train.epochs, epoch_done)
    if cfg.ps.placement == "task":
        if resumed is not None:
            progress.restore(resumed)  # epochs the resumed run logged
        return _train_with_task_ps(spark, cfg, manifest, spec, steps, store, latest if resumed else None,
                                   initial_parameters, initial.numel(), progress, expected, checkpoint_extra)
    host = _ps_host(spark, cfg)
    started = time.perf_counter()
    log.info("training %s: %d workers x %d steps/epoch x %d epochs, %d parameters, PS on %s",
             cfg.name, workers, steps, cfg.train.epochs, initial.numel(), host)
    ranges = stage_ranges(spec, cfg) if stages > 1 else None
    if ranges is not None:
        log.info("pipeline parallelism: %d replicas x %d stages (parameter slices %s), %d micro-batches",
                 replicas, stages, ranges, cfg.parallelism.micro_batches)
    secret = new_secret()
    server_kwargs = dict(secret=secret, optimizer=_optimizer(cfg), host=host, timeout_s=cfg.ps.timeout_s, generation=1,
                         on_metrics=progress, consistency=consistency, compression=cfg.ps.compression,
                         topk_ratio=cfg.ps.topk_ratio, shards=cfg.ps.shards)
    if ranges is not None:
        from pipeline.ps.staged import StagedParameterServer

        ps = StagedParameterServer(initial, ranges, replicas=replicas, **server_kwargs)
    else:
        ps = ParameterServer(initial, world_size=workers, **server_kwargs)
    with ps as server:
        if resumed is not None:
            server.load_state_dict(resumed["ps"])
            progress.restore(resumed)
            log.info("resuming from checkpoint %s at step %d of %d", latest.path, server.version, expected)

        def snapshot() -> dict:
            return take_snapshot(server, progress, consistency, steps, cfg.train.epochs, model=spec.to_dict(),
                                 epochs=cfg.train.epochs, seed=cfg.train.seed,
                                 **_checkpoint_meta(cfg, manifest, steps, checkpoint_extra))

        # allreduce keeps no state on the server: nothing to checkpoint, and a retry starts over.
        with Checkpointer(store, snapshot, lambda: server.version, cfg.train.checkpoint_every,
                          enabled=not allreduce) as checkpointer:
            failed_attempts: list[dict] = []
            rows = _attempts(spark, cfg, server, secret, manifest, spec, steps, bar, progress, checkpointer,
                             failed_attempts)
            if allreduce:
                parameters, version = _replica_parameters(rows, initial.numel(), stages), min(r["steps"] for r in rows)
                expected = steps * cfg.train.epochs
            else:
                parameters, version = server.parameters(), server.version
            stats = dict(server.stats)
            checkpointer.save("end of training")
    seconds = time.perf_counter() - started
    if version != expected:
        raise WorkerTrainingFailedError({}, cause=f"training applied {version} steps, expected {expected}")
    log.info("training done: %d steps in %.1fs; ranks ran in %s", version, seconds,
             ", ".join(f"{r['rank']}@{r['process']} ({r['device']}{', gpu ' + r['gpu'] if r['gpu'] else ''})"
                       for r in sorted(rows, key=lambda r: r["rank"])))
    ranks = [{k: v for k, v in r.items() if k != "parameters"} for r in sorted(rows, key=lambda r: r["rank"])]
    return TrainResult(spec=spec, parameters=parameters, history=progress.history, ranks=ranks,
                       steps=version, seconds=seconds, ps_stats=stats, failed_attempts=failed_attempts,
                       resumed_from_step=None if resumed is None else int(resumed["step"]))


def _replica_parameters(rows: list[dict], num_params: int, stages: int = 1):
    """allreduce: rank 0's parameters, after checking that every replica ended bit-identical. With
    pipeline stages, each stage's replica 0 (rank = stage) returns its slice; they are concatenated."""
    import torch

    for stage in range(stages):
        digests = {r["rank"]: r["parameters_digest"] for r in rows if r["rank"] % stages == stage}
        if len(set(digests.values())) != 1:
            raise WorkerTrainingFailedError({}, cause=f"the allreduce replicas disagree at the end (sha256 by rank: "
                                                      f"{digests}); this is a bug, please report it")
    raw = b"".join(bytes(next(r["parameters"] for r in rows if r["rank"] == stage)) for stage in range(stages))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    if flat.numel() != num_params:
        raise WorkerTrainingFailedError({}, cause=f"rank 0 returned {flat.numel()} parameters, the model has "
                                                  f"{num_params}")
    return flat


def _attempts(spark, cfg: PipelineConfig, server, secret: bytes, manifest: Manifest, spec: ModelSpec, steps: int, bar,
              progress: EpochProgress, checkpointer: "Checkpointer", failed_attempts: list[dict]) -> list[dict]:
    """Run barrier attempts until one succeeds or train.max_attempts are spent; return its rows."""
    attempt = 1
    while True:
        plans = _plans(cfg, manifest, spec, steps, server.generation, attempt, getattr(server, "addresses", None))
        try:
            return _run_attempt(spark, cfg, server, secret, plans, bar, attempt)
        except WorkerTrainingFailedError as failure:
            _give_up_after_last_attempt(failure, attempt, cfg.train.max_attempts)
            failed_attempts.append({"attempt": attempt, "ranks": sorted(failure.failures), "step": server.version,
                                    "error": str(failure)[:4000]})
            log.warning("attempt %d of %d failed; retrying from step %d with the PS state kept\n%s", attempt,
                        cfg.train.max_attempts, server.version, failure)
            checkpointer.save(f"after failed attempt {attempt}")
            try:
                server.new_generation()
            except PSError as exc:  # e.g. pipeline stages left one step apart: cannot continue safely
                failure.cause = f"{failure.cause + '; ' if failure.cause else ''}cannot retry: {exc}"
                raise WorkerTrainingFailedError(failure.failures, attempt, failure.cause, failure.stopped) from failure
            _close_abandoned_epochs(server, progress, cfg, steps)
            attempt += 1


def _close_abandoned_epochs(server, progress: EpochProgress, cfg: PipelineConfig, steps: int) -> None:
    """Before a retry: epochs a dead rank stepped past without reporting are summarized from the others
    (the retried rank starts after them and will not report them)."""
    if cfg.train.backend == "allreduce":
        return  # every rank starts over
    try:
        state = server.state_dict()
    except PSError:  # bookkeeping only: the retry itself does not depend on it
        log.warning("could not read the PS state to settle the epochs of the failed attempt", exc_info=True)
        return
    progress.close_abandoned(epochs_left_unreported(state, progress.reports(), _consistency(cfg), progress.world_size,
                                                    steps, cfg.train.epochs))


def _give_up_after_last_attempt(failure: WorkerTrainingFailedError, attempt: int, max_attempts: int) -> None:
    """Stamp the attempt on the failure; after the last allowed one, raise it saying so."""
    failure.attempt = attempt
    if attempt >= max_attempts:
        failure.cause = (f"{failure.cause + '; ' if failure.cause else ''}gave up after {attempt} "
                         f"attempt(s) (train.max_attempts={max_attempts})")
        raise WorkerTrainingFailedError(failure.failures, attempt, failure.cause, failure.stopped) from failure


def _run_attempt(spark, cfg: PipelineConfig, server, secret: bytes, plans: list[dict], bar, attempt: int) -> list[dict]:
    """One barrier job; raises WorkerTrainingFailedError naming the root-cause rank(s)."""
    workers = cfg.parallelism.tasks
    ps_host, ps_port = server.address
    task_fn = make_task_fn(plans, ps_host, ps_port, secret, cfg.train.log_tail_lines)
    ranks_df = spark.range(0, workers, 1, workers)
    tag = f"shardline-train-{uuid.uuid4().hex[:12]}"
    # allreduce peers blocked in a collective cannot hear the PS abort, so a failed attempt is cancelled
    # after a short grace instead of waiting for their collective timeout.
    grace_s = min(cfg.ps.timeout_s, 3.0) if cfg.train.backend == "allreduce" else cfg.ps.timeout_s
    watchdog = StageWatchdog(server, workers, connect_timeout_s=cfg.ps.timeout_s, grace_s=grace_s,
                             cancel=lambda reason: _interrupt(spark, tag))
    log.info("barrier attempt %d (generation %d) from step %d", attempt, server.generation, server.version)
    spark.addTag(tag)
    try:
        with watchdog, bar:
            rows = merge_chunks([r.asDict() for r in ranks_df.mapInArrow(task_fn, RESULT_SCHEMA,
                                                                         barrier=True).collect()])
    except BaseException as exc:
        if isinstance(exc, Exception):
            _await_rank_failure(server, min(cfg.ps.timeout_s, 2.0))
        server.fail(f"the Spark barrier job failed: {_spark_error_summary(exc)}")
        _interrupt(spark, tag)
        if not isinstance(exc, Exception):  # KeyboardInterrupt & co: stop, do not retry
            raise
        unknown = WorkerFailure(-1, watchdog.reason or "the barrier stage failed before any rank reported "
                                                       "(see the Spark error)")
        failures = server.root_failures or dict(server.failures) or {-1: unknown}
        raise WorkerTrainingFailedError(failures, attempt, cause=watchdog.reason or _spark_error_summary(exc)) from exc
    finally:
        spark.removeTag(tag)
    failed = [r for r in rows if not r["ok"]]
    if failed:
        root_causes = list(server.root_failures)  # in the order the server heard of them
        if cfg.train.backend == "allreduce" and root_causes:
            # A rank that dies takes its peers' collectives down with it ("Connection closed by peer"):
            # those are consequences, and the server heard of the cause first.
            root_causes = root_causes[:1]
        primary = [r for r in failed if r["rank"] in root_causes] or failed
        raise WorkerTrainingFailedError(
            {r["rank"]: WorkerFailure(r["rank"], r["error"], r["log_tail"] or "") for r in primary}, attempt,
            stopped={r["rank"]: r["error"] for r in failed if r not in primary})
    return rows


def _await_rank_failure(server, wait_s: float) -> None:
    """When Spark reports the stage failed, give the PS a moment to hear which rank it was (a killed
    worker's connection drops at once, but the server's thread may not have recorded it yet): once the
    server is told the job failed, later drops count as consequences, not as the cause."""
    deadline = time.monotonic() + wait_s
    while not server.failures and time.monotonic() < deadline:
        time.sleep(0.02)


def _checkpoint_meta(cfg: PipelineConfig, manifest: Manifest, steps: int, extra: Optional[dict]) -> dict:
    """What every checkpoint records besides the PS state, so a resume can check it belongs to this run."""
    return {"fingerprint": manifest.fingerprint, "world_size": cfg.parallelism.data, "mode": cfg.ps.mode,
            "steps_per_epoch": steps, "extra": dict(extra or {})}


def _train_with_task_ps(spark, cfg: PipelineConfig, manifest: Manifest, spec: ModelSpec, steps: int, store,
                        resume_from, initial_parameters, num_params: int, progress: EpochProgress, expected: int,
                        checkpoint_extra: Optional[dict]) -> TrainResult:
    """ps.placement=task: each attempt's PS lives in rank 0's task; a retry restarts it from the newest
    checkpoint; the history and final parameters come back as result rows."""
    from pipeline.launch.task_ps import HostedPSSpec
    from pipeline.ps import new_secret

    workers, allreduce = cfg.parallelism.data, cfg.train.backend == "allreduce"
    warm = (initial_parameters.detach().to("cpu").float().reshape(-1).contiguous().numpy().tobytes()
            if initial_parameters is not None else None)
    log.info("training %s: %d workers x %d steps/epoch x %d epochs, PS in rank 0's task (ps.placement=task)",
             cfg.name, workers, steps, cfg.train.epochs)
    started, failed_attempts, attempt = time.perf_counter(), [], 1
    resumed_from = resume_from
    # Marks this run's checkpoints: a retry resumes only from one of them (or from --resume's).
    launch_id = uuid.uuid4().hex
    meta = {**_checkpoint_meta(cfg, manifest, steps, checkpoint_extra), "launch_id": launch_id}
    while True:
        secret = new_secret()  # per attempt: a late task of a failed attempt cannot join the next one
        hosted = HostedPSSpec(
            world_size=workers, epochs=cfg.train.epochs, steps_per_epoch=steps, generation=attempt,
            optimizer=dataclasses.asdict(_optimizer(cfg)), consistency=dataclasses.asdict(_consistency(cfg)),
            compression=cfg.ps.compression, topk_ratio=cfg.ps.topk_ratio, shards=cfg.ps.shards,
            timeout_s=cfg.ps.timeout_s, grace_s=min(cfg.ps.timeout_s, 3.0) if allreduce else cfg.ps.timeout_s,
            model=spec.to_dict(), seed=cfg.train.seed, checkpoint_dir=store.directory,
            keep_checkpoints=cfg.train.keep_checkpoints, checkpoint_every=cfg.train.checkpoint_every,
            checkpoints_enabled=not allreduce, resume_path=resume_from.path if resume_from else None,
            warm_start=warm, checkpoint_meta=meta).to_dict()
        plans = _plans(cfg, manifest, spec, steps, attempt, attempt)
        try:
            rows, report = _run_task_attempt(spark, cfg, plans, secret, hosted, attempt)
        except WorkerTrainingFailedError as failure:
            _give_up_after_last_attempt(failure, attempt, cfg.train.max_attempts)
            resume_from = None if allreduce else _own_latest(store, launch_id, resume_from)
            failed_attempts.append({"attempt": attempt, "ranks": sorted(failure.failures),
                                    "step": resume_from.step if resume_from else 0, "error": str(failure)[:4000]})
            log.warning("attempt %d of %d failed; retrying from %s\n%s", attempt, cfg.train.max_attempts,
                        f"checkpoint step {resume_from.step}" if resume_from else "the start", failure)
            attempt += 1
            continue
        break
    progress.replay(report["history"])
    if allreduce:
        parameters, version = _replica_parameters(rows, num_params), min(r["steps"] for r in rows)
        expected = steps * cfg.train.epochs
    else:
        import torch

        raw = next(r["parameters"] for r in rows if r["rank"] == 0)
        parameters, version = torch.frombuffer(bytearray(raw), dtype=torch.float32), int(report["version"])
    seconds = time.perf_counter() - started
    if version != expected:
        raise WorkerTrainingFailedError({}, cause=f"training applied {version} steps, expected {expected}")
    ranks = [{k: v for k, v in r.items() if k not in ("parameters", "ps_report")} for r in rows]
    stats = dict(report["stats"])  # through JSON: restore the integer rank keys
    if isinstance(stats.get("steps_applied_by_rank"), dict):
        stats["steps_applied_by_rank"] = {int(k): v for k, v in stats["steps_applied_by_rank"].items()}
    _warn_if_checkpoints_invisible(store, report)
    log.info("training done: %d steps in %.1fs (PS in rank 0's task at %s)", version, seconds, report["address"])
    return TrainResult(spec=spec, parameters=parameters, history=progress.history, ranks=ranks, steps=version,
                       seconds=seconds, ps_stats=stats, failed_attempts=failed_attempts,
                       resumed_from_step=resumed_from.step if resumed_from else None)


def _warn_if_checkpoints_invisible(store, report: dict) -> None:
    """Rank 0's task writes the checkpoints; a path only its executor can see makes retries start over."""
    written = set(report.get("checkpoints") or [])
    if written and not written & {c.step for c in store.list()}:
        log.warning("rank 0's task wrote checkpoints at steps %s to %s, but the driver cannot see them there: "
                    "with ps.placement=task, train.checkpoint_dir must be shared storage (an fsspec URL or a "
                    "mount every node sees), or a retry starts from scratch", sorted(written), store.directory)


def _own_latest(store, launch_id: str, fallback):
    """The newest checkpoint this run wrote (rank 0's task saves one when an attempt fails), else fallback."""
    latest = store.latest()
    if latest is None:
        return fallback
    try:
        own = store.load(latest).get("launch_id") == launch_id
    except Exception:  # unreadable: fall back rather than fail the retry
        log.warning("could not read checkpoint %s to resume the retry", latest.path, exc_info=True)
        own = False
    return latest if own else fallback


def _run_task_attempt(spark, cfg: PipelineConfig, plans: list[dict], secret: bytes, hosted: dict,
                      attempt: int) -> tuple[list[dict], dict]:
    """One barrier job with the PS in rank 0's task: (rows, rank 0's PS report), or
    WorkerTrainingFailedError naming the root-cause rank(s) as the task PS saw them."""
    workers = cfg.parallelism.data
    task_fn = make_task_fn(plans, None, None, secret, cfg.train.log_tail_lines, hosted=hosted)
    tag = f"shardline-train-{uuid.uuid4().hex[:12]}"
    log.info("barrier attempt %d (PS in rank 0's task)", attempt)
    spark.addTag(tag)
    try:
        rows = merge_chunks([r.asDict() for r in spark.range(0, workers, 1, workers)
                             .mapInArrow(task_fn, RESULT_SCHEMA, barrier=True).collect()])
    except BaseException as exc:
        _interrupt(spark, tag)
        if not isinstance(exc, Exception):  # KeyboardInterrupt & co: stop, do not retry
            raise
        why = _spark_error_summary(exc)
        embedded = decode_failure_report(str(exc))
        if embedded and embedded.get("failures"):
            # Rank 0 stopped the stage itself (ranks stuck past the deadline) and sent its PS's account.
            roots = [int(r) for r in embedded.get("root_failures", [])] or [int(r) for r in embedded["failures"]]
            failures = {int(r): WorkerFailure(int(r), e, t) for r, (e, t) in embedded["failures"].items()
                        if int(r) in roots[:1]}
            raise WorkerTrainingFailedError(failures, attempt, cause=embedded.get("reason", why)) from exc
        # No rank could report (the stage is torn down as soon as one task dies); Spark names the task.
        crashed = re.search(r"barrier task ResultTask\(\d+, (\d+)\)", str(exc))
        rank = int(crashed.group(1)) if crashed else -1
        text = (f"the task of rank {rank} died and Spark stopped the barrier stage" if crashed else
                "the barrier stage failed before the ranks reported")
        if rank <= 0:
            text += " (rank 0's task hosts the parameter server: its state since the last checkpoint is lost)"
        raise WorkerTrainingFailedError({rank: WorkerFailure(rank, text)}, attempt, cause=why) from exc
    finally:
        spark.removeTag(tag)
    head = next((r for r in rows if r["rank"] == 0), None)
    report = json.loads(head["ps_report"]) if head is not None and head.get("ps_report") else None
    failed = [r for r in rows if not r["ok"]]
    if failed or report is None:
        roots = [int(r) for r in (report or {}).get("root_failures", [])]
        if cfg.train.backend == "allreduce":
            roots = roots[:1]
        primary = [r for r in failed if r["rank"] in roots] or failed
        failures = {r["rank"]: WorkerFailure(r["rank"], r["error"], r["log_tail"] or "") for r in primary}
        raise WorkerTrainingFailedError(failures or {0: WorkerFailure(0, "rank 0 returned no PS report")}, attempt,
                                        stopped={r["rank"]: r["error"] for r in failed if r not in primary})
    return rows, report


class Checkpointer:
    """Saves a snapshot every `every` applied steps from a background thread, and on request."""

    def __init__(self, store, snapshot: Callable[[], dict], version: Callable[[], int], every: int,
                 poll_s: float = 0.1, enabled: bool = True):
        import threading

        self._store, self._snapshot, self._version = store, snapshot, version
        self._enabled = enabled
        self._every = every if enabled else 0
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = version()
        self._thread = threading.Thread(target=self._watch, name="shardline-checkpointer", daemon=True)
        self.saved: list[int] = []

    def __enter__(self) -> "Checkpointer":
        if self._every:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def save(self, why: str, periodic: bool = False) -> None:
        """Best effort: a failing checkpoint write is logged, never allowed to stop training."""
        if not self._enabled:
            return
        with self._lock:
            try:
                state = self._snapshot()
                info = self._store.save(state)
                self._last = state["step"]
                self.saved.append(state["step"])
                log.info("checkpoint at step %d (%s): %s", state["step"], why, info.path)
            except SnapshotNotReady as why_not:
                # Periodic saves retry at the next poll; a skipped request leaves the previous checkpoint.
                log.log(logging.DEBUG if periodic else logging.INFO, "checkpoint (%s) skipped: %s", why, why_not)
            except Exception:
                log.warning("could not write a checkpoint (%s) to %s", why, self._store.directory, exc_info=True)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self._version() - self._last >= self._every:
                self.save(f"every {self._every} steps", periodic=True)


def _interrupt(spark, tag: str) -> None:
    try:
        spark.interruptTag(tag)
    except Exception:  # teardown is best effort; the original error is what matters
        log.debug("could not interrupt jobs tagged %s", tag, exc_info=True)
