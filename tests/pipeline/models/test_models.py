import os
import sys

import pytest
import torch

from pipeline.config.schema import ModelConfig
from pipeline.errors import ConfigError, DataError
from pipeline.models import build_model, flat_parameters, load_flat_parameters, model_spec, num_parameters
from pipeline.models.build import ModelSpec
from pipeline.models.flat import flat_gradients

sys.path.insert(0, os.path.dirname(__file__))  # makes user_models importable as a top-level module


def test_mlp_shape_and_spec_round_trip():
    spec = model_spec(ModelConfig(hidden=[16, 8]), num_features=5, num_classes=3, task="classification")
    model = build_model(ModelSpec.from_dict(spec.to_dict()))
    assert model({"numeric": torch.zeros(4, 5)}).shape == (4, 3)
    assert num_parameters(model) == (5 * 16 + 16) + (16 * 8 + 8) + (8 * 3 + 3)


def test_logreg_and_regression_outputs():
    spec = model_spec(ModelConfig(kind="logreg"), num_features=5, num_classes=None, task="regression")
    assert build_model(spec)({"numeric": torch.zeros(2, 5)}).shape == (2, 1)
    with pytest.raises(DataError, match="at least 2"):
        model_spec(ModelConfig(), num_features=5, num_classes=1, task="classification")


def test_user_factory_and_its_errors():
    spec = model_spec(ModelConfig(factory="user_models:tiny_mlp", factory_kwargs={"width": 3}),
                      num_features=4, num_classes=2, task="classification")
    model = build_model(spec)
    # The classic factory's own layers follow the NumericInput adapter, under the names it gave them.
    assert type(model[0]).__name__ == "NumericInput" and model[1].out_features == 3
    assert [name for name, _ in model.named_children()] == ["input", "0", "1", "2"]
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        build_model(model_spec(ModelConfig(factory="user_models:not_a_module"), num_features=4, num_classes=2,
                               task="classification"))
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg'"):
        build_model(model_spec(ModelConfig(factory="no_such_pkg:f"), num_features=4, num_classes=2,
                               task="classification"))


def test_flat_parameters_round_trip_and_gradients():
    torch.manual_seed(0)
    a = build_model(model_spec(ModelConfig(), num_features=6, num_classes=3, task="classification"))
    b = build_model(model_spec(ModelConfig(), num_features=6, num_classes=3, task="classification"))
    load_flat_parameters(b, flat_parameters(a))
    x = {"numeric": torch.randn(7, 6)}
    assert torch.equal(a(x), b(x))
    a(x).sum().backward()
    grads = flat_gradients(a)
    assert torch.equal(grads, torch.cat([p.grad.reshape(-1) for p in a.parameters()]))
    with pytest.raises(ValueError, match="elements"):
        load_flat_parameters(b, torch.zeros(3))
