"""The per-task training loop (no Spark imports)."""
from pipeline.worker.loop import WorkerResult, run
from pipeline.worker.plan import WorkerPlan

__all__ = ["WorkerPlan", "WorkerResult", "run"]
