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
    expected_version: int  # the PS version once every planned step is applied
    store: CheckpointStore
    progress: EpochProgress
    checkpoint_meta: CheckpointMeta  # what every checkpoint of this run records
    resumed: Optional[dict] = None  # the --resume checkpoint's state
    resumed_from: Optional[CheckpointInfo] = None  # its file
    warm_started: bool = False

    @property
    def allreduce(self) -> bool:
        return self.cfg.train.backend == "allreduce"


@dataclass(frozen=True)
class Outcome:
    """What the successful attempt left: the merged parameters and the PS's account."""

    parameters: "torch.Tensor"  # flat fp32
    version: int
    expected: int
    stats: dict
    rows: list[dict]
    # train.early_stopping / train.divergence: why the result is the best epoch's (StopInfo.to_dict()).
    stopped: Optional[dict] = None

