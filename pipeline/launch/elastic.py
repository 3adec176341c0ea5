"""Driver side: how many workers a run gets (train.min_workers) and where a run's steps fall in its epochs
(the StreamPlan of pipeline.data.assignment), fresh or resumed with another parallelism.data."""
from __future__ import annotations

import logging
from typing import Optional

from pipeline.config.schema import PipelineConfig
from pipeline.data.assignment import StreamPlan
from pipeline.errors import ConfigError
from pipeline.shards import Manifest

log = logging.getLogger(__name__)


def fit_workers(spark, cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` with parallelism.data lowered to the task slots there are when train.min_workers allows it;
    otherwise ``cfg`` unchanged (the barrier-slot preflight then fails, naming slots and workers)."""
    from pipeline.config.loader import with_changes
    from pipeline.launch.preflight import task_slots

    asked, least = cfg.parallelism.data, cfg.train.min_workers
    if least is None:
        return cfg
    if least > asked:
        raise ConfigError(f"train.min_workers={least} is more than parallelism.data={asked}; set train.min_workers "
                          f"<= {asked} (or null)")
    if cfg.parallelism.pipeline > 1:
        raise ConfigError("train.min_workers needs parallelism.pipeline=1 (a replica's stages are gang-scheduled "
                          "together); set train.min_workers=null")
    slots = task_slots(spark)
    if slots is None or slots >= asked:
        return cfg
    if slots < least:
        raise ConfigError(f"parallelism.data={asked} workers asked, train.min_workers={least} at least, but this Spark "
                          f"session has {slots} task slot(s); add executors/cores or lower train.min_workers")
    log.warning("ELASTIC START: parallelism.data=%d asked, only %d task slot(s) available: training with %d "
                "workers (train.min_workers=%d); steps per epoch are recomputed for %d", asked, slots, slots, least,
                slots)
    return with_changes(cfg, parallelism={"data": slots})


def stream_plan(cfg: PipelineConfig, manifest: Manifest, steps: int, resumed: Optional[dict] = None) -> StreamPlan:
    """The run's StreamPlan: a fresh one, or the resumed checkpoint's carried on to this run's world size
    (checkpoints from before elastic resume record none: theirs was the fresh plan of their layout)."""
    fresh = StreamPlan(manifest.split("train").rows, cfg.parallelism.data, steps, 0, None,
                       cfg.data.shuffle_buffer_rows, cfg.data.shuffle)
    if resumed is None:
        return fresh
    record = resumed.get("stream")
    before = (StreamPlan.of(record) if record else
              StreamPlan(manifest.split("train").rows, int(resumed["world_size"]), int(resumed["steps_per_epoch"]),
                         0, None, cfg.data.shuffle_buffer_rows, cfg.data.shuffle))
    plan = before.resume(int(resumed["step"]), cfg.parallelism.data, cfg.train.batch_size,
                         cfg.data.shuffle_buffer_rows, cfg.data.shuffle)
    if plan != before:
        _check_elastic(cfg, before)
        epoch, batch = plan.locate(int(resumed["step"]))
        log.warning("ELASTIC RESUME at step %d: %d -> %d workers, %d -> %d steps/epoch; epoch %d continues with %d "
                    "step(s) over the rows it has left%s", int(resumed["step"]), before.world, plan.world,
                    before.steps_per_epoch, plan.steps_per_epoch, epoch + 1, plan.steps_per_epoch - batch,
                    "" if plan.resumed is None or plan.resumed.epoch != epoch
                    else f" ({sum(b - a for a, b in plan.resumed.intervals)} rows)")
    return plan


def _check_elastic(cfg: PipelineConfig, before: StreamPlan) -> None:
    """What a change of world size (or batch size) on resume needs."""
    changed = (f"the checkpoint ran {before.world} workers x {before.steps_per_epoch} steps/epoch, the config now "
               f"gives parallelism.data={cfg.parallelism.data} and train.batch_size={cfg.train.batch_size}")
    if cfg.data.reader == "petastorm":
        raise ConfigError(f"cannot resume with another layout: {changed}, and data.reader=petastorm reads each "
                          "worker's own shard; set data.reader=arrow, or use the run's parallelism.data and batch size")
    if cfg.ps.mode != "sync":
        raise ConfigError(f"cannot resume with another layout: {changed}, and ps.mode={cfg.ps.mode} keeps per-rank "
                          "positions; resume with ps.mode=sync, or with the run's parallelism.data and batch size")
    if cfg.parallelism.pipeline > 1:
        raise ConfigError(f"cannot resume with another layout: {changed}, and parallelism.pipeline="
                          f"{cfg.parallelism.pipeline}; use the run's parallelism.data and batch size")
