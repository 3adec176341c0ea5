"""Stage cutting of models whose first child is an input adapter taking the batch dict."""
import os
import sys

import pytest
import torch
import torch.nn as nn

from pipeline.config.feature_spec import FeatureSet, FeatureSpec
from pipeline.config.schema import ModelConfig
from pipeline.errors import ConfigError
from pipeline.models import build_model, flat_parameters, model_spec
from pipeline.models.inputs import NumericInput, TabularInput
from pipeline.parallel.stages import cut_points, split_stages, stage_slices

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))  # user_models

NUMERIC = FeatureSet.numeric_only([f"x{i}" for i in range(8)])
MIXED = FeatureSet((FeatureSpec(name="a", type="numeric"),
                    FeatureSpec(name="colour", type="categorical", vocab_size=30, embedding_dim=8)))


def mlp(features=NUMERIC, hidden=(16, 16, 16)):
    torch.manual_seed(0)
    return build_model(model_spec(ModelConfig(hidden=list(hidden)), features=features, num_classes=3,
                                  task="classification"))


def layers_without_adapter(model):
    return nn.Sequential(*list(model.children())[1:])


def run(stages, batch):
    x = batch
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("stages, cuts", [(2, None), (3, None), (4, None), (3, [2, 4]), (2, [6])])
def test_cuts_mean_the_same_layers_as_without_the_adapter(stages, cuts):
    model = mlp()
    adapter = model[0]
    assert adapter.shardline_input and not list(adapter.parameters())
    plain = layers_without_adapter(model)
    starts = cut_points(model, stages, cuts)
    assert starts == cut_points(plain, stages, cuts)
    parts = split_stages(model, stages, cuts)
    assert parts[0][0] is adapter
    # Each later stage starts with the layer the index names, and layer i is the child named "i".
    for part, start in zip(parts[1:], starts):
        assert part[0] is plain[start] and next(iter(part._modules)) == str(start)
    assert torch.equal(torch.cat([flat_parameters(p) for p in parts]), flat_parameters(model))
    assert [b - a for a, b in stage_slices(parts)] == [sum(p.numel() for p in s.parameters())
                                                       for s in split_stages(plain, stages, cuts)]
    batch = {"numeric": torch.randn(5, 8)}
    assert torch.equal(run(parts, batch), model(batch))


def test_bad_cuts_count_layers_without_the_adapter():
    with pytest.raises(ConfigError, match="the model has 7 layers"):
        cut_points(mlp(), 2, [7])
    with pytest.raises(ConfigError, match=r"parallelism.pipeline is 5 but the model has only 4 layer"):
        cut_points(mlp(), 5)


def test_an_adapter_with_embeddings_is_a_layer():
    model = mlp(MIXED, hidden=(16,))
    assert isinstance(model[0], TabularInput) and sum(p.numel() for p in model[0].parameters()) == 30 * 8 + 16
    # Layers: the adapter (index 0), Linear, ReLU, Linear.
    first, second = split_stages(model, 2, cuts=[1])
    assert list(first.children()) == [model[0]] and second[0] is model[1]
    assert cut_points(model, 3) == [1, 3]
    batch = {"numeric": torch.randn(4, 1), "colour": torch.randint(0, 32, (4,))}
    assert torch.equal(second(first(batch)), model(batch))


def test_a_classic_factorys_stages_keep_the_adapter_in_stage_0():
    model = build_model(model_spec(ModelConfig(factory="user_models:nan_stages"), num_features=4, num_classes=2,
                                   task="classification"))
    children = list(model.children())
    assert model.shardline_stages and isinstance(children[0], NumericInput)
    parts = split_stages(children, 2)
    assert len(parts) == 2 and isinstance(parts[0][0], NumericInput) and parts[0][1] is children[1]
    assert parts[1] is children[2]
    with pytest.raises(ConfigError, match="returned 2 stage modules; set parallelism.pipeline: 2"):
        split_stages(children, 1)
    assert torch.equal(torch.cat([flat_parameters(p) for p in parts]), flat_parameters(model))
    hidden = parts[0]({"numeric": torch.ones(3, 4)})
    assert hidden.shape == (3, 8)
