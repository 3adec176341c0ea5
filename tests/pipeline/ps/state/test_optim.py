"""OptimizerSpec validation (fails on the driver, naming the config key) and optimizer construction."""
from __future__ import annotations

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.ps import OptimizerSpec
from pipeline.ps.state.optim import build_optimizer


@pytest.mark.parametrize("kwargs, key", [
    ({"name": "lbfgs"}, "train.optimizer"),
    ({"lr": 0.0}, "train.lr"),
    ({"lr": float("nan")}, "train.lr"),
    ({"momentum": 1.0}, "train.momentum"),
    ({"weight_decay": -1.0}, "train.weight_decay"),
    ({"betas": (0.9, 1.0)}, "betas"),
])
def test_invalid_spec_names_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        OptimizerSpec(**kwargs)


def test_build_optimizer_uses_the_spec() -> None:
    flat = torch.zeros(3, requires_grad=True)
    sgd = build_optimizer(OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01), flat)
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.param_groups[0]["momentum"] == 0.9 and sgd.param_groups[0]["weight_decay"] == 0.01
    adam = build_optimizer(OptimizerSpec("adam", lr=0.01, betas=(0.8, 0.99)), flat)
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["betas"] == (0.8, 0.99)
