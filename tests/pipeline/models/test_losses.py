"""model.loss: each loss against torch's own on the same outputs, the output heads, and the errors a
wrong setting gets."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import build
from pipeline.errors import ConfigError
from pipeline.models import ModelSpec, build_model, loss_fn, model_spec
from pipeline.models.losses import LossSpec


def spec_for(task: str = "classification", classes: int = 3, labels=None, target_scale=None, **model) -> ModelSpec:
    cfg = build({"model": {"hidden": [8], **model}, "data": {"task": task}})
    return model_spec(cfg.model, num_features=4, num_classes=classes if task == "classification" else None,
                      task=task, labels=labels, target_scale=target_scale)


def batch(classes: int = 3, rows: int = 32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, classes, generator=g), torch.randint(0, classes, (rows,), generator=g)


def test_class_weights_change_the_loss_exactly_as_torchs_cross_entropy():
    logits, labels = batch()
    weights = [1.0, 3.0, 0.5]
    ours = loss_fn(spec_for(class_weights=weights))(logits, labels)
    assert torch.allclose(ours, torch.nn.CrossEntropyLoss(weight=torch.tensor(weights))(logits, labels))
    assert not torch.allclose(ours, F.cross_entropy(logits, labels))  # the weights do change it
    by_label = spec_for(labels=("a", "b", "c"), class_weights={"b": 3.0, "c": 0.5})  # "a" unnamed: weight 1
    assert torch.allclose(loss_fn(by_label)(logits, labels), ours)


def test_label_smoothing_is_torchs():
    logits, labels = batch()
    ours = loss_fn(spec_for(label_smoothing=0.1))(logits, labels)
    assert torch.allclose(ours, torch.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, labels))


def test_bce_emits_one_logit_whose_two_class_softmax_is_its_sigmoid():
    spec = spec_for(classes=2, loss="bce")
    model = build_model(spec)
    assert model[-2].out_features == 1  # the network's own output: one logit
    x = {"numeric": torch.randn(16, 4)}
    out = model(x)
    assert out.shape == (16, 2) and torch.equal(out[:, 0], torch.zeros(16))
    z = out[:, 1]
    assert torch.allclose(out.softmax(1)[:, 1], torch.sigmoid(z))
    labels = torch.randint(0, 2, (16,))
    ours = loss_fn(spec)(out, labels)
    assert torch.allclose(ours, F.binary_cross_entropy_with_logits(z, labels.float()))
    # class weights: torch's per-row weight w[y], a plain mean
    weighted = loss_fn(spec_for(classes=2, loss="bce", class_weights=[1.0, 4.0]))(out, labels)
    rows = torch.tensor([1.0, 4.0])[labels]
    assert torch.allclose(weighted, torch.nn.BCEWithLogitsLoss(weight=rows)(z, labels.float()))


def test_regression_learns_the_standardized_target_and_predicts_on_the_labels_scale():
    spec = spec_for("regression", target_scale=(1000.0, 250.0))
    model = build_model(spec)
    x = {"numeric": torch.randn(8, 4)}
    with torch.no_grad():
        standardized = model[:-1](x).squeeze(-1)  # the network without its TargetScale head
        out = model(x).squeeze(-1)
    assert torch.allclose(out, standardized * 250.0 + 1000.0)
    target = torch.tensor([900.0, 1100.0, 1000.0, 1500.0, 700.0, 1000.0, 1250.0, 750.0])
    ours = loss_fn(spec)(model(x), target)
    assert torch.allclose(ours, F.mse_loss(standardized, (target - 1000.0) / 250.0), atol=1e-5)
    huber = loss_fn(spec_for("regression", target_scale=(1000.0, 250.0), loss="huber", huber_delta=0.5))
    assert torch.allclose(huber(model(x), target), F.huber_loss(standardized, (target - 1000.0) / 250.0, delta=0.5),
                          atol=1e-5)
    raw = spec_for("regression", target_scale=(1000.0, 250.0), standardize_target=False)
    assert raw.target_scale is None and not any(type(m).__name__ == "TargetScale" for m in build_model(raw).modules())


def test_a_spec_round_trips_through_json_with_its_loss_and_target_scale():
    import json

    spec = spec_for("regression", target_scale=(12.5, 3.0), loss="huber")
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert LossSpec.from_dict(spec.loss).kind == "huber"


def test_a_user_loss_factory_gets_its_kwargs_and_the_standardized_values():
    spec = spec_for("regression", target_scale=(10.0, 2.0), loss="tests.pipeline.models.user_losses:scaled_l1",
                    loss_kwargs={"scale": 3.0})
    out, target = torch.tensor([[12.0], [8.0]]), torch.tensor([10.0, 10.0])
    assert torch.allclose(loss_fn(spec)(out, target), torch.tensor(3.0))  # 3 * mean(|1|, |-1|)


@pytest.mark.parametrize("task, model, match", [
    ("classification", {"loss": "mse"}, "regression loss but data.task=classification"),
    ("regression", {"loss": "cross_entropy"}, "classification loss but data.task=regression"),
    ("classification", {"loss": "bce"}, "bce needs exactly two classes"),
    ("classification", {"class_weights": [1.0, 2.0]}, "2 weights but there are 3 classes"),
    ("classification", {"class_weights": {"zebra": 2.0}}, "not label values"),
    ("regression", {"class_weights": [1.0]}, "class_weights is for classification"),
])
def test_a_loss_that_does_not_fit_the_task_is_an_error_naming_the_key(task, model, match):
    with pytest.raises(ConfigError, match=match):
        spec_for(task, **model)


def test_unknown_losses_and_bad_weights_fail_at_load_time():
    with pytest.raises(ConfigError, match="model.loss"):
        build({"model": {"loss": "hinge"}})
    with pytest.raises(ConfigError, match="model.class_weights"):
        build({"model": {"class_weights": [1.0, 0.0]}})
    with pytest.raises(ConfigError, match="cannot import module"):
        loss_fn(spec_for("regression", loss="no_such_module:fn"))
