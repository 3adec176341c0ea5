"""Driver side: what both placements are given about the run, and what the successful attempt leaves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeline.config.schema import PipelineConfig
from pipeline.models import ModelSpec
from pipeline.shards import Manifest


@dataclass
class TrainingRun:
    """What both placements need about the run (driver side only: it holds the SparkSession)."""

    spark: object
    cfg: PipelineConfig
    manifest: Manifest
    spec: ModelSpec
    steps_per_epoch: int
    initial: object  # flat fp32 tensor: the seeded initialization or the warm start
    expected_version: int  # the PS version once every planned step is applied
    store: object  # checkpoints.CheckpointStore
    progress: object  # ps_side.progress.EpochProgress
    resumed: Optional[dict] = None  # the --resume checkpoint's state
    resumed_from: object = None  # its CheckpointInfo
    checkpoint_meta: Optional[dict] = None  # plain values every checkpoint records
    warm_started: bool = False

    @property
    def allreduce(self) -> bool:
        return self.cfg.train.backend == "allreduce"


@dataclass(frozen=True)
class Outcome:
    """What the successful attempt left: the merged parameters and the PS's account."""

    parameters: object
    version: int
    expected: int
    stats: dict
    rows: list

