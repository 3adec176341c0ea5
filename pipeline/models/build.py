"""Model construction from a plain, picklable spec, so executors rebuild exactly the driver's model."""
from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from pipeline.config.schema import ModelConfig

_ACTIVATIONS = {"relu": "ReLU", "tanh": "Tanh", "gelu": "GELU"}


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild the model anywhere: plain values only (crosses into Spark tasks)."""

    kind: str
    num_features: int
    num_outputs: int
    task: str
    hidden: tuple[int, ...] = ()
    activation: str = "relu"
    dropout: float = 0.0
    factory: Optional[str] = None
    factory_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        data = dict(data)
        data["hidden"] = tuple(data.get("hidden", ()))
        return cls(**data)


def model_spec(config: ModelConfig, *, num_features: int, num_classes: Optional[int], task: str) -> ModelSpec:
    num_outputs = num_classes if task == "classification" else 1
    if task == "classification" and (num_classes is None or num_classes < 2):
        from pipeline.errors import DataError

        raise DataError(f"classification needs at least 2 label classes, found {num_classes}")
    return ModelSpec(
        kind="factory" if config.factory else config.kind,
        num_features=num_features,
        num_outputs=num_outputs,
        task=task,
        hidden=tuple(config.hidden),
        activation=config.activation,
        dropout=config.dropout,
        factory=config.factory,
        factory_kwargs=dict(config.factory_kwargs),
    )


def _resolve_factory(path: str) -> Callable[..., Any]:
    from pipeline.errors import ConfigError

    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model.factory: cannot import module {module_name!r} ({exc}); "
                          "it must be importable on the driver and on every executor") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model.factory: {module_name!r} has no callable {attr!r}")
    return factory


def build_model(spec: ModelSpec):
    """A fresh torch module for `spec`. Built-ins are plain nn.Sequential so they load without our code."""
    import torch.nn as nn

    if spec.kind == "factory":
        model = _resolve_factory(spec.factory)(num_features=spec.num_features, num_outputs=spec.num_outputs,
                                                **spec.factory_kwargs)
        if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
            # A factory may return its pipeline stages; the whole model is their composition, and each
            # stage stays one child, so parallelism.pipeline cuts it exactly there.
            model = nn.Sequential(*model)
            model.shardline_stages = True
        if not isinstance(model, nn.Module):
            from pipeline.errors import ConfigError

            raise ConfigError(f"model.factory {spec.factory!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model
    if spec.kind == "logreg":
        return nn.Sequential(nn.Linear(spec.num_features, spec.num_outputs))
    layers: list[nn.Module] = []
    width = spec.num_features
    for hidden in spec.hidden:
        layers += [nn.Linear(width, hidden), getattr(nn, _ACTIVATIONS[spec.activation])()]
        if spec.dropout:
            layers.append(nn.Dropout(spec.dropout))
        width = hidden
    layers.append(nn.Linear(width, spec.num_outputs))
    return nn.Sequential(*layers)


def model_from_flat(spec: dict, parameters):
    """An eval-mode module for a spec dict holding flat fp32 `parameters` (bytes, an array, or a Spark
    broadcast of either): how scoring UDFs rebuild the trained model on executors."""
    import numpy as np
    import torch

    from pipeline.models.flat import load_flat_parameters

    value = parameters.value if hasattr(parameters, "value") else parameters
    flat = (np.frombuffer(value, dtype=np.float32) if isinstance(value, (bytes, bytearray, memoryview))
            else np.asarray(value, dtype=np.float32))
    model = build_model(ModelSpec.from_dict(spec))
    load_flat_parameters(model, torch.from_numpy(flat.copy()))
    model.eval()
    return model


def loss_fn(task: str):
    """Mean loss over a batch; classification takes int64 class indices, regression float targets."""
    import torch.nn.functional as F

    if task == "classification":
        return F.cross_entropy

    def mse(output, target):
        return F.mse_loss(output.squeeze(-1), target)

    return mse
