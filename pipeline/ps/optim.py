"""The optimizer the parameter server applies to its flat parameter vector.

The server owns one flat fp32 tensor and steps a real ``torch.optim`` optimizer over ``[flat]``.
SGD (with momentum / weight decay) and Adam are elementwise, so stepping the flat vector is exactly
what stepping each original parameter would do; that is why a flat buffer is safe here and why only
elementwise optimizers are offered.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError

logger = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class OptimizerSpec:
    """What optimizer the PS runs. Field names mirror the ``train.*`` config keys they come from."""

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    def __post_init__(self) -> None:
        # Validated here so a bad spec fails on the driver before any worker is launched.
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"train.optimizer: {self.name!r} is not supported by the parameter server "
                f"(choose one of {', '.join(OPTIMIZERS)})"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"train.lr must be a finite number > 0, got {self.lr!r}")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise ConfigError(f"train.momentum must be in [0, 1), got {self.momentum!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer betas must be two numbers in [0, 1), got {self.betas!r}")


def build_optimizer(spec: OptimizerSpec, flat: torch.Tensor | list[torch.Tensor]) -> torch.optim.Optimizer:
    """Create the torch optimizer over ``[flat]`` (the server; the caller sets ``flat.grad`` before each
    step) or over a list of tensors (an ``average``-mode worker's local optimizer over its model)."""
    params = [flat] if isinstance(flat, torch.Tensor) else list(flat)
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    return torch.optim.Adam(
        params, lr=spec.lr, betas=tuple(spec.betas), weight_decay=spec.weight_decay
    )
