"""Driver orchestration of the barrier training stage (the only user of BarrierTaskContext)."""
from pipeline.launch.train import TrainResult, train

__all__ = ["TrainResult", "train"]
