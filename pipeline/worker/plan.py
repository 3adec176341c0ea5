"""What one barrier task needs to train, as plain values (it crosses into a Spark closure)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    world_size: int
    generation: int
    train_files: tuple[str, ...]
    # Only rank 0 evaluates the validation split at the end of each epoch.
    validation_files: tuple[str, ...]
    model: dict  # ModelSpec.to_dict()
    task: str
    num_features: int
    features_field: str
    label_field: str
    epochs: int
    steps_per_epoch: int
    seed: int
    prefetch: int
    ps_timeout_s: float
    extra: dict = field(default_factory=dict)
    # OptimizerSpec fields: the local optimizer of ps.mode=average and of the allreduce backend (the
    # other modes step on the server).
    optimizer: dict = field(default_factory=dict)
    backend: str = "ps"  # train.backend: ps | allreduce

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WorkerPlan":
        data = dict(data)
        data["train_files"] = tuple(data["train_files"])
        data["validation_files"] = tuple(data["validation_files"])
        return cls(**data)
