"""model.kind = cnn: structure, its refusals, and that it learns sklearn's 8x8 digits."""
import numpy as np
import pytest
import torch
import torch.nn as nn

from pipeline.config.feature_spec import FeatureSet, FeatureSpec
from pipeline.config.schema import ModelConfig
from pipeline.errors import ConfigError
from pipeline.models import build_model, loss_fn, model_spec, num_parameters
from pipeline.models.inputs import ImageInput
from pipeline.parallel.stages import split_stages

DIGIT = FeatureSpec(name="digit", type="image", height=8, width=8, channels=1)


def cnn(features, hidden=(64,)):
    return build_model(model_spec(ModelConfig(kind="cnn", hidden=list(hidden)), features=features, num_classes=10,
                                  task="classification"))


def test_image_only_cnn_is_a_flat_sequential_of_conv_layers():
    model = cnn(FeatureSet((DIGIT,)))
    assert isinstance(model[0], ImageInput) and num_parameters(model[0]) == 0
    kinds = [type(m).__name__ for m in list(model.children())[1:]]
    # 8x8 is below the pooling threshold: no max-pool, the adaptive pool keeps 4x4.
    assert kinds == ["Conv2d", "ReLU", "Conv2d", "ReLU", "AdaptiveAvgPool2d", "Flatten", "Linear", "ReLU", "Linear"]
    # Pipeline stages cut between the conv layers; the adapter runs in stage 0.
    first, second = split_stages(model, 2, cuts=[2])
    assert isinstance(first[0], ImageInput) and isinstance(second[0], nn.Conv2d)
    pixels = torch.randint(0, 256, (3, 1, 8, 8), dtype=torch.uint8)
    assert torch.equal(second(first({"digit": pixels})), model({"digit": pixels}))


def test_large_images_are_pooled():
    big = FeatureSpec(name="photo", type="image", height=64, width=48, channels=3)
    model = cnn(FeatureSet((big,)), hidden=())
    assert sum(isinstance(m, nn.MaxPool2d) for m in model) == 2
    out = model({"photo": torch.randint(0, 256, (2, 3, 64, 48), dtype=torch.uint8)})
    assert out.shape == (2, 10)


@pytest.mark.parametrize("features, found", [
    ((FeatureSpec(name="a", type="numeric"),), "found 0 .*a \\(numeric\\)"),
    ((DIGIT, FeatureSpec(name="other", type="image", height=4, width=4, channels=3)), "found 2"),
])
def test_cnn_needs_exactly_one_image(features, found):
    with pytest.raises(ConfigError, match=f"model.kind=cnn needs exactly one image feature.*{found}"):
        cnn(FeatureSet(features))


def test_cnn_learns_digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    pixels = torch.from_numpy(np.clip(x * 16, 0, 255).astype(np.uint8).reshape(-1, 1, 8, 8))
    labels = torch.from_numpy(y)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:1350], order[1350:]
    torch.manual_seed(0)
    model = cnn(FeatureSet((DIGIT,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    loss = loss_fn("classification")
    for _ in range(3):
        model.train()
        for rows in train[torch.randperm(len(train))].split(32):
            optimizer.zero_grad()
            loss(model({"digit": pixels[rows]}), labels[rows]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model({"digit": pixels[test]}).argmax(1) == labels[test]).float().mean().item()
    assert accuracy > 0.9
