"""Failures of a training step that a retry cannot cure, typed so the driver does not retry them.

A NaN/Inf loss replays identically on a retry (same seed, data and model), and so does a model (or a
loss) that raises on its input batch; both say what to change. Errors of a broken process group or
stage link are left as they are: they are the retryable consequence of another rank's failure.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from pipeline.errors import ModelInputError, NonFiniteError, ShardlineError

if TYPE_CHECKING:
    from pipeline.models import ModelSpec

# Text of the RuntimeErrors torch raises (through DDP, or a collective) when a peer's group went away.
_GROUP_MARKERS = ("gloo", "nccl", "processgroup", "process group", "connection closed", "connection reset",
                  "broken pipe")
# Text of the RuntimeErrors of a failing device (a lost or faulty GPU, memory exhausted): the machine's
# fault, not the batch's, and another attempt (maybe on another executor) may succeed.
_DEVICE_MARKERS = ("cuda error", "cudnn_status", "cublas_status", "out of memory", "ecc error", "nvml")


def check_finite(loss: float, *, rank: int, step: int, epoch: int, where: str = "") -> None:
    """Raise NonFiniteError when a batch's loss (the ``.item()`` the loop takes anyway) is NaN/Inf."""
    if not math.isfinite(loss):
        raise NonFiniteError(
            f"rank {rank}{where}: the training loss is {loss} at step {step} (epoch {epoch}); the parameters "
            "diverged or the batch holds NaN/Inf values: lower train.lr (or clip the inputs), and check the "
            "training data for NaN/Inf features or labels")


def keeps_its_type(exc: BaseException) -> bool:
    """Whether ``exc``, raised during a forward, is not the model's fault and so is not made a
    ModelInputError: shardline's own errors (PSError, and so the stage-link errors pipeline.parallel
    raises), OSError, torch.distributed's errors and the gloo/nccl RuntimeErrors DDP passes through
    (fallout of another rank), and running out of memory (a resource, not the batch)."""
    if not isinstance(exc, Exception) or isinstance(exc, (ShardlineError, OSError, MemoryError)):
        return True
    if type(exc).__module__.startswith("torch.distributed") or type(exc).__name__ == "OutOfMemoryError":
        return True
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except (ImportError, AttributeError):  # torch without distributed support
        pass
    # Only torch's plain RuntimeError carries gloo/nccl failures; a subclass of its own is the model's.
    text = str(exc).lower()
    return type(exc) is RuntimeError and any(marker in text for marker in _GROUP_MARKERS + _DEVICE_MARKERS)


def describe_tensor(tensor) -> str:
    if tensor is None:
        return "none"
    if isinstance(tensor, dict):  # a batch's inputs
        return "{" + ", ".join(f"{key}: {describe_tensor(value)}" for key, value in tensor.items()) + "}"
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def describe_model(spec: ModelSpec) -> str:
    if spec.kind == "factory":
        return f"model.factory={spec.factory!r}"
    return f"model.kind={spec.kind!r}"


def model_input_error(exc: Exception, spec: ModelSpec, *, rank: int, step: int, epoch: int, inputs: str,
                      where: str = "") -> ModelInputError:
    """The ModelInputError for ``exc``, raised by the model's forward (or the loss) on a batch described
    by ``inputs``; raise it ``from exc``."""
    return ModelInputError(
        f"rank {rank}{where}: the model raised on its input batch at step {step} (epoch {epoch}): "
        f"{type(exc).__name__}: {exc}; batch {inputs}; {describe_model(spec)} ({spec.task}, "
        f"features {_feature_summary(spec)}, num_outputs={spec.num_outputs}); fix the model so its forward "
        f"takes the batch dict (keys {spec.feature_set.batch_keys()}) and its output suits the {spec.task} "
        "loss, or check data.features and the shards' columns")


def _feature_summary(spec: ModelSpec) -> str:
    features = spec.feature_set
    parts = [f"numeric[{features.numeric_width}]"] if features.numeric else []
    parts += [f"{f.name}:{f.type}" for f in features if f.type != "numeric"]
    return "{" + ", ".join(parts) + "}"


def batch_inputs(features=None, labels=None, *, received: Optional[str] = None) -> str:
    """What a step fed the model, for a ModelInputError: features and labels (and, on a middle
    pipeline stage, where its activations came from)."""
    parts = []
    if received is not None:
        parts.append(f"activations {received}")
    if features is not None:
        parts.append(f"features {describe_tensor(features)}")
    if labels is not None:
        parts.append(f"labels {describe_tensor(labels)}")
    return ", ".join(parts) or "none"
