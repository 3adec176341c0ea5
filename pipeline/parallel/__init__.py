"""Pipeline model parallelism (GPipe): cut a model into stages, link adjacent stages, run the schedule.

Imports only torch, the standard library and pipeline.wire / pipeline.models / pipeline.errors, so it runs
inside a worker without Spark or MLflow.
"""
from pipeline.parallel.link import StageLink, StageListener, connect_link
from pipeline.parallel.schedule import GPipeStage, StageStats, bubble_fraction, split_rows
from pipeline.parallel.stages import cut_points, split_stages, stage_slices

__all__ = ["StageLink", "StageListener", "connect_link", "GPipeStage", "StageStats", "bubble_fraction",
           "split_rows", "cut_points", "split_stages", "stage_slices"]
