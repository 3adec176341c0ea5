"""Built-in models and factories on typed features: every model's forward takes the batch dict."""
import json
import os
import pickle
import sys

import pytest
import torch
import torch.nn as nn

from pipeline.config.feature_spec import FeatureSet, FeatureSpec
from pipeline.config.schema import ModelConfig
from pipeline.errors import ConfigError
from pipeline.models import build_model, flat_parameters, load_flat_parameters, model_from_flat, model_spec
from pipeline.models import num_parameters
from pipeline.models.build import ModelSpec
from pipeline.models.inputs import NumericInput, TabularInput

sys.path.insert(0, os.path.dirname(__file__))  # makes user_models importable as a top-level module

B = 6
FEATURES = FeatureSet((
    FeatureSpec(name="age", type="numeric", standardize=True, mean=40.0, std=10.0),
    FeatureSpec(name="income", type="numeric", impute="mean", missing_flag=True),
    FeatureSpec(name="city", type="categorical", vocab_size=5),                 # 7 ids, width 5
    FeatureSpec(name="emb", type="vector", length=4),
    FeatureSpec(name="photo", type="image", height=8, width=8, channels=1),
    FeatureSpec(name="review", type="text", vocab_size=10, max_len=6, embedding_dim=4),  # 12 ids
))
# numeric 2 + 1 missing flag, city 5, emb 4, photo 64 pixels, review 4
TABULAR_WIDTH = 3 + 5 + 4 + 64 + 4
EMBEDDING_PARAMS = 7 * 5 + 12 * 4


def make_batch(features: FeatureSet = FEATURES, rows: int = B, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {"numeric": torch.randn(rows, features.numeric_width, generator=g)} if features.numeric else {}
    for f in features:
        if f.type == "categorical":
            batch[f.name] = torch.randint(0, f.cardinality, (rows,), generator=g)
        elif f.type == "vector":
            batch[f.name] = torch.randn(rows, f.length, generator=g)
        elif f.type == "image":
            batch[f.name] = torch.randint(0, 256, (rows, f.channels, f.height, f.width), generator=g,
                                          dtype=torch.uint8)
        elif f.type == "text":
            lengths = torch.randint(0, f.max_len + 1, (rows,), generator=g)
            tokens = torch.randint(1, f.cardinality, (rows, f.max_len), generator=g)
            tokens[torch.arange(f.max_len).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
            batch[f.name], batch[f.name + "__len"] = tokens, lengths
    assert sorted(batch) == sorted(features.batch_keys())
    return batch


def spec_for(kind: str, features: FeatureSet = FEATURES, hidden=(16,), **extra) -> ModelSpec:
    return model_spec(ModelConfig(kind=kind, hidden=list(hidden), **extra), features=features, num_classes=3,
                      task="classification")


def expected_parameters(kind: str) -> int:
    if kind == "logreg":
        return EMBEDDING_PARAMS + TABULAR_WIDTH * 3 + 3
    if kind in ("mlp", "tabular"):
        return EMBEDDING_PARAMS + (TABULAR_WIDTH * 16 + 16) + (16 * 3 + 3)
    # cnn over the photo; the other features through a TabularInput after the conv tower
    tower = (1 * 32 * 9 + 32) + (32 * 64 * 9 + 64)
    head_in = 64 * 4 * 4 + (TABULAR_WIDTH - 64)
    return tower + EMBEDDING_PARAMS + (head_in * 16 + 16) + (16 * 3 + 3)


@pytest.mark.parametrize("kind", ["mlp", "tabular", "logreg", "cnn"])
def test_every_kind_takes_the_dict_trains_and_round_trips(kind):
    torch.manual_seed(0)
    spec = spec_for(kind)
    model = build_model(spec)
    assert model[0].shardline_input
    batch = make_batch()
    out = model(batch)
    assert out.shape == (B, 3) and out.dtype == torch.float32
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # The categorical ids used in the batch got gradient, the unused rows none.
    city = next(m for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == 7)
    used = batch["city"].unique()
    assert city.weight.grad[used].abs().sum(1).gt(0).all()
    assert num_parameters(model) == expected_parameters(kind)

    for data in (spec.to_dict(), json.loads(json.dumps(spec.to_dict())), pickle.loads(pickle.dumps(spec)).to_dict()):
        again = ModelSpec.from_dict(data)
        assert again == spec and again.feature_set == FEATURES
        rebuilt = build_model(again)
        load_flat_parameters(rebuilt, flat_parameters(model))
        model.eval()
        rebuilt.eval()
        assert torch.equal(rebuilt(batch), model(batch))
    scored = model_from_flat(spec.to_dict(), flat_parameters(model).numpy().tobytes())
    assert torch.equal(scored(batch), model(batch))


def test_tabular_input_layout():
    adapter = TabularInput(FEATURES)
    assert adapter.out_features == TABULAR_WIDTH and num_parameters(adapter) == EMBEDDING_PARAMS
    batch = make_batch()
    row = adapter(batch)
    assert row.shape == (B, TABULAR_WIDTH)
    assert torch.equal(row[:, :3], batch["numeric"])
    city, review = adapter.embeddings
    assert torch.equal(row[:, 3:8], city(batch["city"]))
    assert torch.equal(row[:, 8:12], batch["emb"])
    assert torch.equal(row[:, 12:76], batch["photo"].flatten(1).float() / 255)
    assert row[:, 12:76].min() >= 0 and row[:, 12:76].max() <= 1
    for i in range(B):
        n = int(batch["review__len"][i])
        want = review(batch["review"][i, :n]).mean(0) if n else torch.zeros(4)
        assert torch.allclose(row[i, 76:], want, atol=1e-6)


def test_text_mean_ignores_tokens_past_the_length():
    adapter = TabularInput(FEATURES)
    batch = make_batch()
    batch["review__len"] = torch.full((B,), 2)
    noisy = dict(batch, review=batch["review"].clone())
    noisy["review"][:, 2:] = 9
    assert torch.equal(adapter(batch), adapter(noisy))


def test_numeric_only_matches_the_classic_mlp():
    features = FeatureSet.numeric_only(["a", "b", "c", "d"])
    spec = spec_for("mlp", features, hidden=(8,))
    assert spec.num_features == 4 and spec.feature_set == features
    model = build_model(spec)
    assert num_parameters(model[0]) == 0
    torch.manual_seed(1)
    old = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    load_flat_parameters(model, flat_parameters(old))
    assert [p.shape for p in model.parameters()] == [p.shape for p in old.parameters()]
    x = torch.randn(5, 4)
    assert torch.equal(model({"numeric": x}), old(x))
    # Callers from before the dict batch pass the numeric block itself.
    assert torch.equal(model(x), old(x))
    # A classic spec (no features) builds the same model.
    classic = build_model(model_spec(ModelConfig(hidden=[8]), num_features=4, num_classes=3,
                                     task="classification"))
    load_flat_parameters(classic, flat_parameters(old))
    assert torch.equal(classic({"numeric": x}), old(x))


def test_a_model_with_embeddings_refuses_a_bare_tensor():
    model = build_model(spec_for("mlp"))
    with pytest.raises(TypeError, match="reads the batch dict"):
        model(torch.zeros(2, 3))


def test_spec_without_features_and_old_dicts():
    spec = model_spec(ModelConfig(), num_features=3, num_classes=2, task="classification")
    assert spec.features == ()
    assert spec.feature_set == FeatureSet.numeric_only(["x0", "x1", "x2"], standardize=False)
    old = {k: v for k, v in spec.to_dict().items() if k != "features"}
    assert ModelSpec.from_dict(old) == spec
    with pytest.raises(ValueError, match="disagrees"):
        model_spec(ModelConfig(), num_features=2, features=FEATURES, num_classes=2, task="classification")
    with pytest.raises(ValueError, match="numeric block"):
        ModelSpec(kind="mlp", num_features=1, num_outputs=2, task="classification", features=tuple(FEATURES.to_list()))


def test_head_settings_apply_to_every_kind():
    for kind in ("mlp", "cnn"):
        model = build_model(spec_for(kind, hidden=(16, 8), activation="tanh", dropout=0.25))
        head = [m for m in model.children() if isinstance(m, (nn.Linear, nn.Tanh, nn.Dropout))]
        assert [type(m).__name__ for m in head] == ["Linear", "Tanh", "Dropout", "Linear", "Tanh", "Dropout",
                                                    "Linear"]
        assert [m.out_features for m in head if isinstance(m, nn.Linear)] == [16, 8, 3]


def test_classic_factory_is_wrapped_and_sees_the_numeric_block():
    features = FeatureSet.numeric_only(["a", "b", "c", "d"])
    spec = model_spec(ModelConfig(factory="user_models:tiny_mlp", factory_kwargs={"width": 3}), features=features,
                      num_classes=2, task="classification")
    model = build_model(spec)
    assert isinstance(model[0], NumericInput)
    inner = nn.Sequential(*list(model.children())[1:])
    x = torch.randn(4, 4)
    assert torch.equal(model({"numeric": x}), inner(x))

    stages = build_model(model_spec(ModelConfig(factory="user_models:nan_stages"), num_features=4, num_classes=2,
                                    task="classification"))
    assert stages.shardline_stages and len(stages) == 3 and isinstance(stages[0], NumericInput)

    with pytest.raises(ConfigError, match=r"takes num_features .* city \(categorical\)"):
        build_model(model_spec(ModelConfig(factory="user_models:tiny_mlp"), features=FEATURES, num_classes=2,
                               task="classification"))


def test_classic_factory_returning_any_module_is_wrapped(tmp_path, monkeypatch):
    (tmp_path / "plain_factory.py").write_text(
        "import torch.nn as nn\n"
        "def bilinear(num_features, num_outputs):\n"
        "    return nn.Bilinear(num_features, num_features, num_outputs)\n"
        "class Square(nn.Module):\n"
        "    def __init__(self, n, k):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(n, k)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x * x)\n"
        "def square(num_features, num_outputs):\n"
        "    return Square(num_features, num_outputs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model(model_spec(ModelConfig(factory="plain_factory:square"), num_features=3, num_classes=2,
                                   task="classification"))
    assert [name for name, _ in model.named_children()] == ["input", "model"]
    x = torch.randn(2, 3)
    assert torch.equal(model({"numeric": x}), model.model(x))


def test_new_style_factory_gets_the_feature_set():
    spec = model_spec(ModelConfig(factory="user_models:dict_model", factory_kwargs={"scale": 7}), features=FEATURES,
                      num_classes=3, task="classification")
    model = build_model(ModelSpec.from_dict(spec.to_dict()))
    assert model.features == FEATURES and model.scale == 7
    assert model(make_batch()).shape == (B, 3)
    with pytest.raises(ConfigError, match="returned list, not a torch.nn.Module"):
        build_model(model_spec(ModelConfig(factory="user_models:dict_not_a_module"), features=FEATURES,
                               num_classes=3, task="classification"))


def test_unknown_kind_is_refused():
    with pytest.raises(ConfigError, match="model.kind 'rnn'"):
        build_model(ModelSpec(kind="rnn", num_features=2, num_outputs=2, task="classification"))


def test_exported_model_takes_the_dict():
    """The tracked model is logged through torch.export; the adapters must trace with a dynamic batch."""
    from torch.export import Dim, export

    model = build_model(spec_for("mlp")).eval()
    batch = make_batch()
    rows = Dim("rows", min=2)
    dynamic = ({key: {0: rows} for key in batch},)
    program = export(model, (batch,), dynamic_shapes=dynamic)
    other = make_batch(rows=9, seed=3)
    with torch.no_grad():
        assert torch.allclose(program.module()(other), model(other), atol=1e-6)
