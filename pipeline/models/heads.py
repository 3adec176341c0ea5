"""The fixed output heads of ``pipeline.models.losses`` (no parameters, no buffers): plain torch modules,
so an exported model holds them as ordinary ops and loads without shardline."""
from __future__ import annotations

import torch
import torch.nn as nn


class BinaryLogits(nn.Module):
    """One logit ``z`` -> the two class logits ``[0, z]`` (softmax: ``[1 - sigmoid(z), sigmoid(z)]``)."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z.reshape(z.shape[0], 1)
        return torch.cat([torch.zeros_like(z), z], dim=1)


class TargetScale(nn.Module):
    """Standardized prediction -> the label's scale: ``out * std + mean``. Plain floats, not parameters
    or buffers: nothing to train, nothing for the PS to carry, constants in torch.export."""

    def __init__(self, mean: float, std: float) -> None:
        super().__init__()
        self.mean, self.std = float(mean), float(std)

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        return out * self.std + self.mean

    def extra_repr(self) -> str:
        return f"mean={self.mean:g}, std={self.std:g}"
