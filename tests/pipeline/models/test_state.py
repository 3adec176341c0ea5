"""The flat model state: parameters + buffers, their exact encoding, and the replicas' merge rule."""
import pytest
import torch
import torch.nn as nn

from pipeline.models.state import (buffer_layout, decode_buffer, encode_buffer, flat_buffers, flat_state,
                                   layout_slots, load_flat_state, merge_buffers, split_buffers, state_size)


def _bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _trained(model, steps=3):
    model.train()
    for _ in range(steps):
        model(torch.randn(8, 3) * 3 + 1)
    return model


def test_batchnorm_buffers_are_part_of_the_flat_state_and_load_back_exactly():
    model = _trained(_bn())
    assert buffer_layout(model) == (("float32", 4), ("float32", 4), ("int64", 1))
    state = flat_state(model)
    assert state.numel() == state_size(model) == (3 * 4 + 4) + (4 + 4) + (4 * 2 + 2) + (4 + 4 + 2)  # int64: 2 words
    fresh = _bn()
    assert not torch.equal(fresh[1].running_mean, model[1].running_mean)
    load_flat_state(fresh, state)
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh[1].num_batches_tracked.item() == 3


def test_a_parameters_only_vector_still_loads_and_leaves_buffers_alone():
    model, fresh = _trained(_bn()), _bn()
    load_flat_state(fresh, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert torch.equal(fresh[1].running_var, torch.ones(4))
    with pytest.raises(ValueError, match="buffer words"):
        load_flat_state(fresh, torch.zeros(state_size(model) + 1))


@pytest.mark.parametrize("tensor", [torch.tensor([0, 1, 2 ** 40 + 3, -5], dtype=torch.int64),
                                    torch.tensor([1e-300, -2.5], dtype=torch.float64),
                                    torch.tensor([7, -1], dtype=torch.int32),
                                    torch.tensor([True, False]), torch.tensor([0.5, -3.0], dtype=torch.float16),
                                    torch.tensor([1, 255], dtype=torch.uint8)])
def test_every_dtype_round_trips_bit_exactly(tensor):
    words = encode_buffer(tensor)
    assert words.dtype is torch.float32
    assert torch.equal(decode_buffer(words, str(tensor.dtype).removeprefix("torch."), tensor.numel()), tensor)


def test_merge_averages_float_buffers_and_takes_integer_buffers_from_the_lowest_rank():
    layout = (("float32", 2), ("int64", 1))
    a = torch.cat([encode_buffer(torch.tensor([1.0, 2.0])), encode_buffer(torch.tensor([10]))])
    b = torch.cat([encode_buffer(torch.tensor([3.0, 6.0])), encode_buffer(torch.tensor([11]))])
    mean, count = split_buffers(layout, merge_buffers(layout, {1: b, 0: a}))
    assert torch.equal(mean, torch.tensor([2.0, 4.0])) and count.dtype is torch.int64 and count.item() == 10
    assert layout_slots(layout) == 4


def test_non_persistent_buffers_are_not_state():
    model = nn.Linear(2, 2)
    model.register_buffer("cache", torch.ones(100), persistent=False)
    model.register_buffer("scale", torch.full((3,), 2.0))
    assert buffer_layout(model) == (("float32", 3),) and flat_buffers(model).tolist() == [2.0, 2.0, 2.0]


def test_built_in_models_take_an_optional_batch_norm_and_old_specs_stay_equal():
    from pipeline.config.schema import ModelConfig
    from pipeline.models import build_model, model_spec
    from pipeline.models.build import ModelSpec

    plain = model_spec(ModelConfig(hidden=[8, 4]), num_features=3, num_classes=2, task="classification")
    assert "batch_norm" not in plain.to_dict()  # a checkpoint's spec from before the key still matches
    assert ModelSpec.from_dict(plain.to_dict()) == plain
    spec = model_spec(ModelConfig(hidden=[8, 4], batch_norm=True), num_features=3, num_classes=2,
                      task="classification")
    assert ModelSpec.from_dict(spec.to_dict()) == spec and spec.to_dict()["batch_norm"] is True
    model = build_model(spec)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    assert [n.num_features for n in norms] == [8, 4]
    assert buffer_layout(model) == (("float32", 8), ("float32", 8), ("int64", 1),
                                    ("float32", 4), ("float32", 4), ("int64", 1))
    assert not [m for m in build_model(plain).modules() if isinstance(m, nn.BatchNorm1d)]
