"""Launching a training run. Driver side at this level (``train``, ``attempts``, ``retry``, ``placement``,
``plans``, ``merge``, ``preflight``); ``launch.task`` runs inside the barrier tasks; ``launch.ps_side`` runs
beside the parameter server, wherever it is (the driver, or rank 0's task)."""
from pipeline.launch.train import TrainResult, train

__all__ = ["TrainResult", "train"]
