"""Driver-side orchestration of one training run: preflight, PS, barrier stage, results, teardown.

This module (with task.py) is the only place that touches BarrierTaskContext. The barrier stage runs
through the DataFrame API (`mapInArrow(..., barrier=True)`), which is the same barrier stage as
`rdd.barrier()` but also works where a session has no SparkContext (Spark Connect).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from pipeline.config.schema import PipelineConfig
from pipeline.errors import WorkerFailure, WorkerTrainingFailedError
from pipeline.launch.preflight import check_barrier_slots
from pipeline.launch.progress import EpochProgress, StepProgress
from pipeline.launch.task import RESULT_SCHEMA, make_task_fn
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


def _plans(cfg: PipelineConfig, manifest: Manifest, spec: ModelSpec, steps: int, generation: int) -> list[dict]:
    has_validation = "validation" in manifest.splits and manifest.split("validation").rows > 0
    validation = tuple(manifest.files("validation")) if has_validation else ()
    faults = {"fail_rank": cfg.faults.fail_rank, "fail_step": cfg.faults.fail_step}

    def extra(rank: int) -> dict:
        loader = {"row_group_rows": manifest.row_group_rows("train", rank), "reader": cfg.data.reader,
                  "shuffle": cfg.data.shuffle, "shuffle_buffer_rows": cfg.data.shuffle_buffer_rows,
                  "reader_threads": cfg.data.reader_threads}
        return {**faults, "loader": loader}

    return [
        WorkerPlan(
            rank=rank, world_size=cfg.parallelism.data, generation=generation,
            train_files=tuple(rank_files(manifest, rank)), validation_files=validation if rank == 0 else (),
            model=spec.to_dict(), task=manifest.task, num_features=manifest.num_features,
            features_field=manifest.features_field, label_field=manifest.label_field, epochs=cfg.train.epochs,
            steps_per_epoch=steps, seed=cfg.train.seed, prefetch=cfg.train.prefetch,
            ps_timeout_s=cfg.ps.timeout_s, extra=extra(rank), optimizer=dataclasses.asdict(_optimizer(cfg)),
        ).to_dict()
        for rank in range(cfg.parallelism.data)
    ]


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


def train(spark, cfg: PipelineConfig, manifest: Manifest,
          on_epoch: Optional[Callable[[dict], None]] = None) -> TrainResult:
    """Train on the shard set with `cfg.parallelism.data` barrier workers synchronized by a driver PS."""
    import torch

    from pipeline.ps import ParameterServer, new_secret
    from pipeline.ps.modes import expected_version

    workers = cfg.parallelism.data
    check_barrier_slots(spark, workers)
    steps = steps_per_epoch(manifest, workers, cfg.train.batch_size)
    spec = model_spec(cfg.model, num_features=manifest.num_features, num_classes=manifest.num_classes,
                      task=manifest.task)
    torch.manual_seed(cfg.train.seed)  # every worker starts from the server's copy of this initialization
    initial = flat_parameters(build_model(spec))
    generation = 1
    plans = _plans(cfg, manifest, spec, steps, generation)
    consistency = _consistency(cfg)
    expected = expected_version(consistency, steps * cfg.train.epochs, workers)
    bar = StepProgress(lambda: server.version, expected)

    def epoch_done(row: dict) -> None:
        bar.update_loss(row)
        if on_epoch is not None:
            on_epoch(row)

    progress = EpochProgress(workers, cfg.train.epochs, epoch_done)
    secret = new_secret()
    host = _ps_host(spark, cfg)
    tag = f"shardline-train-{uuid.uuid4().hex[:12]}"
    started = time.perf_counter()
    log.info("training %s: %d workers x %d steps/epoch x %d epochs, %d parameters, PS on %s",
             cfg.name, workers, steps, cfg.train.epochs, initial.numel(), host)
    with ParameterServer(initial, world_size=workers, secret=secret, optimizer=_optimizer(cfg), host=host,
                         timeout_s=cfg.ps.timeout_s, generation=generation, on_metrics=progress,
                         consistency=consistency, compression=cfg.ps.compression,
                         topk_ratio=cfg.ps.topk_ratio, shards=cfg.ps.shards) as server:
        ps_host, ps_port = server.address
        task_fn = make_task_fn(plans, ps_host, ps_port, secret, cfg.train.log_tail_lines)
        ranks_df = spark.range(0, workers, 1, workers)
        watchdog = StageWatchdog(server, workers, connect_timeout_s=cfg.ps.timeout_s, grace_s=cfg.ps.timeout_s,
                                 cancel=lambda reason: _interrupt(spark, tag))
        spark.addTag(tag)
        try:
            with watchdog, bar:
                rows = [r.asDict() for r in ranks_df.mapInArrow(task_fn, RESULT_SCHEMA, barrier=True).collect()]
        except BaseException as exc:
            server.fail(f"the Spark barrier job failed: {_spark_error_summary(exc)}")
            _interrupt(spark, tag)
            unknown = WorkerFailure(-1, watchdog.reason or "the barrier stage failed before any rank reported "
                                                           "(see the Spark error)")
            failures = server.root_failures or dict(server.failures) or {-1: unknown}
            raise WorkerTrainingFailedError(failures, cause=watchdog.reason or _spark_error_summary(exc)) from exc
        finally:
            spark.removeTag(tag)
        failed = [r for r in rows if not r["ok"]]
        if failed:
            root_causes = set(server.root_failures)
            primary = [r for r in failed if r["rank"] in root_causes] or failed
            raise WorkerTrainingFailedError(
                {r["rank"]: WorkerFailure(r["rank"], r["error"], r["log_tail"] or "") for r in primary},
                stopped={r["rank"]: r["error"] for r in failed if r not in primary})
        parameters = server.parameters()
        version = server.version
        stats = dict(server.stats)
    seconds = time.perf_counter() - started
    if version != expected:
        raise WorkerTrainingFailedError({}, cause=f"the PS applied {version} steps, expected {expected}")
    log.info("training done: %d steps in %.1fs; ranks ran in %s", version, seconds,
             ", ".join(f"{r['rank']}@{r['process']}" for r in sorted(rows, key=lambda r: r["rank"])))
    return TrainResult(spec=spec, parameters=parameters, history=progress.history, ranks=sorted(rows, key=lambda r: r["rank"]),
                       steps=version, seconds=seconds, ps_stats=stats)


def _interrupt(spark, tag: str) -> None:
    try:
        spark.interruptTag(tag)
    except Exception:  # teardown is best effort; the original error is what matters
        log.debug("could not interrupt jobs tagged %s", tag, exc_info=True)
