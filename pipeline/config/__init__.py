"""Typed, validated configuration: `load(path, overrides)` -> frozen `PipelineConfig`."""
from pipeline.config.loader import build, deep_merge, load, parse_override, with_changes
from pipeline.config.schema import (
    DataConfig,
    ModelConfig,
    ParallelismConfig,
    PipelineConfig,
    PSConfig,
    SparkConfig,
    SplitConfig,
    TrackingConfig,
    TrainConfig,
)
from pipeline.config.workdir import Workdir

__all__ = [
    "build", "deep_merge", "load", "parse_override", "with_changes",
    "DataConfig", "ModelConfig", "ParallelismConfig", "PipelineConfig", "PSConfig", "SparkConfig",
    "SplitConfig", "TrackingConfig", "TrainConfig", "Workdir",
]
