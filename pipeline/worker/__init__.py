"""The per-task training loop (no Spark imports): ``run`` picks the flat or the pipeline-stage loop."""
from pipeline.worker.entry import run
from pipeline.worker.plan import WorkerPlan
from pipeline.worker.skeleton import WorkerResult

__all__ = ["WorkerPlan", "WorkerResult", "run"]
