"""Cutting an nn.Sequential into pipeline stages and the stages' slices of the flat parameter vector."""
import pytest
import torch
import torch.nn as nn

from pipeline.errors import ConfigError
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.parallel.stages import cut_points, split_stages, stage_slices


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                         nn.ReLU(), nn.Linear(16, 3))


def test_balanced_cut_minimises_the_largest_stage():
    model = nn.Sequential(nn.Linear(9, 1), nn.Linear(1, 500), nn.ReLU(), nn.Linear(2, 3), nn.Tanh(),
                          nn.Linear(999, 1))
    counts = [sum(p.numel() for p in m.parameters()) for m in model]
    assert counts == [10, 1000, 0, 9, 0, 1000]
    # [10 1000 0 | 9 0 1000] has the smallest maximum (1010); the ReLU stays with its Linear.
    assert cut_points(model, 2) == [3]
    assert cut_points(model, 6 - 2) == [1, 3, 5]


def test_parameterless_layers_stay_with_the_layer_before():
    model = mlp()
    assert cut_points(model, 4) == [2, 4, 6]
    for stage in split_stages(model, 4)[1:]:
        assert isinstance(stage[0], nn.Linear)


def test_leading_parameterless_layers_go_with_the_first_stage():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert cut_points(model, 2) == [3]


def test_balance_on_a_built_in_model_with_dropout():
    spec = ModelSpec(kind="mlp", num_features=32, num_outputs=4, task="classification", hidden=(64, 64, 64),
                     dropout=0.1)
    model = build_model(spec)
    stages = split_stages(model, 2)
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    # 2112 | 4160 | 4160 | 260: the best split puts the first two layers together.
    assert counts == [2112 + 4160, 4160 + 260]
    assert all(not isinstance(s[0], (nn.ReLU, nn.Dropout)) for s in stages)


def test_explicit_cuts_are_used_as_given():
    model = mlp()
    stages = split_stages(model, 3, cuts=[2, 6])
    assert [len(s) for s in stages] == [2, 4, 1]
    assert stages[1][0] is model[2]  # shares the model's layers, hence its parameter tensors


def test_split_keeps_child_names():
    model = mlp()
    stages = split_stages(model, 2)
    assert list(stages[1].state_dict())[0].split(".")[0] == str(cut_points(model, 2)[0])


@pytest.mark.parametrize("cuts, match", [
    ([4], "has 1 entry but parallelism.pipeline is 3"),
    ([4, 2], "strictly increasing"),
    ([2, 2], "strictly increasing"),
    ([0, 4], "out of range"),
    ([2, 7], "out of range"),
    ([3, 4], r"stage 1 \(layers 3..3\) has no parameters"),
    ([2, "4"], "integer layer indices"),
])
def test_bad_cuts_are_refused_naming_the_key(cuts, match):
    with pytest.raises(ConfigError, match=match) as info:
        cut_points(mlp(), 3, cuts)
    assert "parallelism.cuts" in str(info.value)


def test_more_stages_than_parameterised_layers_is_refused():
    with pytest.raises(ConfigError, match=r"parallelism.pipeline is 5 but the model has only 4 layer"):
        cut_points(mlp(), 5)
    with pytest.raises(ConfigError, match="parallelism.pipeline must be an integer >= 1"):
        cut_points(mlp(), 0)


def test_a_model_that_is_not_sequential_is_refused():
    with pytest.raises(ConfigError, match="nn.Sequential"):
        split_stages(nn.Linear(2, 2), 1)


def test_a_list_of_stage_modules_is_taken_as_the_stages():
    parts = [nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2))]
    assert split_stages(parts, 2) == parts
    with pytest.raises(ConfigError, match="returned 2 stage modules; set parallelism.pipeline: 2"):
        split_stages(parts, 1)
    with pytest.raises(ConfigError, match="parallelism.cuts cannot be used"):
        split_stages(parts, 2, cuts=[1])


@pytest.mark.parametrize("stages, cuts", [(1, None), (2, None), (3, None), (4, None), (3, [2, 4]),
                                          (2, [6])])
def test_stage_slices_concatenate_to_the_flat_vector(stages, cuts):
    model = mlp()
    parts = split_stages(model, stages, cuts)
    slices = stage_slices(parts)
    whole = flat_parameters(model)
    assert slices[0][0] == 0 and slices[-1][1] == whole.numel()
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    assert torch.equal(torch.cat([flat_parameters(p) for p in parts]), whole)
    for part, (a, b) in zip(parts, slices):
        assert torch.equal(flat_parameters(part), whole[a:b])
