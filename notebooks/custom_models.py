"""User-defined model factories for notebooks/02_custom_model.py.

A factory is referenced as `model.factory: "custom_models:residual_mlp"` and called on the driver and
on every executor as `factory(num_features=..., num_outputs=..., **model.factory_kwargs)`; it must
return a `torch.nn.Module` mapping a float32 (batch, num_features) tensor to (batch, num_outputs).
This file sits next to the notebook (importable by the driver) and the notebook ships it to the
executors with `pipeline.notebook.ship_module`. Plain torch only: the logged model is exported with
torch.export, so loading it later needs neither this file nor shardline.
"""
from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout),
                                  nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def residual_mlp(num_features: int, num_outputs: int, width: int = 64, blocks: int = 2,
                 dropout: float = 0.0) -> nn.Module:
    """Input projection, `blocks` pre-norm residual blocks of `width`, a normalized linear head."""
    return nn.Sequential(nn.Linear(num_features, width),
                         *[ResidualBlock(width, dropout) for _ in range(blocks)],
                         nn.LayerNorm(width), nn.Linear(width, num_outputs))
