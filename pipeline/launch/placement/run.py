"""Driver side: what both placements are given about the run, and what the successful attempt leaves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from pipeline.checkpoints import CheckpointInfo, CheckpointMeta, CheckpointStore
from pipeline.config.schema import PipelineConfig
from pipeline.launch.ps_side.progress import EpochProgress
from pipeline.models import ModelSpec
from pipeline.shards import Manifest

if TYPE_CHECKING:  # torch stays out of module import time
    import torch


@dataclass
class TrainingRun:
    """What both placements need about the run (driver side only: it holds the SparkSession)."""

    spark: Any  # a classic or a Spark Connect SparkSession
    cfg: PipelineConfig
    manifest: Manifest
    spec: ModelSpec
    steps_per_epoch: int
    initial: "torch.Tensor"  # flat fp32: the seeded initialization or the warm start
    # The model's buffers as fp32 words (pipeline.models.state; empty: none): the initial model's or the
    # warm start's. The server keeps them and merges the replicas' (pipeline.ps.state.buffers).
    initial_buffers: "torch.Tensor"
    expected_version: int  # the PS version once every planned step is applied
    store: CheckpointStore
    progress: EpochProgress
    checkpoint_meta: CheckpointMeta  # what every checkpoint of this run records
    resumed: Optional[dict] = None  # the --resume checkpoint's state
    resumed_from: Optional[CheckpointInfo] = None  # its file
    warm_started: bool = False
    # The caller's on_epoch may ask training to stop (shardline tune's pruner): the driver-hosted PS keeps
    # a monitor for it even with early stopping and the divergence guard off.
    stoppable: bool = False
    # Where the run's steps fall in its epochs (pipeline.data.assignment; None: a fresh plan from
    # steps_per_epoch, offset 0), carried to the workers' plans and every checkpoint.
    stream: Any = None

    @property
    def step_offset(self) -> int:
        return 0 if self.stream is None else self.stream.offset

    @property
    def allreduce(self) -> bool:
        return self.cfg.train.backend == "allreduce"

    def buffer_store(self):
        """The server's store of the whole model's buffers, or None when the model has none."""
        from pipeline.models import build_model

        from pipeline.launch.ps_side.buffers import buffer_store

        if not self.initial_buffers.numel():
            return None
        return buffer_store(build_model(self.spec), self.initial_buffers)

    def stage_buffer_stores(self) -> list:
        """Pipeline stages: each stage's buffers, a store per stage server (None for a stage without)."""
        from pipeline.models import build_model
        from pipeline.launch.ps_side.buffers import buffer_store
        from pipeline.models.state import buffer_layout, layout_slots
        from pipeline.worker.stage_loop import model_stages

        p = self.cfg.parallelism
        stores, offset = [], 0
        for stage in model_stages(build_model(self.spec), p.pipeline, p.cuts):
            words = layout_slots(buffer_layout(stage))
            stores.append(buffer_store(stage, self.initial_buffers[offset:offset + words]) if words else None)
            offset += words
        return stores


@dataclass(frozen=True)
class Outcome:
    """What the successful attempt left: the merged parameters and the PS's account."""

    parameters: "torch.Tensor"  # flat fp32
    version: int
    expected: int
    stats: dict
    rows: list[dict]
    buffers: Optional["torch.Tensor"] = None  # the merged buffers' fp32 words (None/empty: the model has none)
    # train.early_stopping / train.divergence: why the result is the best epoch's (StopInfo.to_dict()).
    stopped: Optional[dict] = None

