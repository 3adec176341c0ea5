"""A user model factory, imported by name through `model.factory` in tests."""
import torch.nn as nn


def tiny_mlp(num_features: int, num_outputs: int, width: int = 8):
    return nn.Sequential(nn.Linear(num_features, width), nn.Tanh(), nn.Linear(width, num_outputs))


def not_a_module(num_features: int, num_outputs: int):
    return "nope"


class _NaNOut(nn.Module):
    """Turns its input into NaN (a model whose loss is never finite)."""

    def forward(self, x):
        return x * float("nan")


class _RejectsInput(nn.Module):
    """Raises on every batch, as a user model does when it expects other inputs than it is given."""

    def forward(self, x):
        raise ValueError(f"expected 7 input features, got {x.shape[-1]}")


def nan_mlp(num_features: int, num_outputs: int):
    return nn.Sequential(nn.Linear(num_features, num_outputs), _NaNOut())


def rejecting_mlp(num_features: int, num_outputs: int):
    return nn.Sequential(nn.Linear(num_features, num_outputs), _RejectsInput())


def nan_stages(num_features: int, num_outputs: int):
    """Two pipeline stages; the last one's output (so its loss) is NaN."""
    return [nn.Sequential(nn.Linear(num_features, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, num_outputs), _NaNOut())]


def rejecting_stages(num_features: int, num_outputs: int):
    """Two pipeline stages; the second raises on the activations it receives."""
    return [nn.Sequential(nn.Linear(num_features, 8), nn.ReLU()),
            nn.Sequential(nn.Linear(8, num_outputs), _RejectsInput())]


class _FirstFeatureHead(nn.Module):
    """A dict-taking model: a linear layer over the numeric block and one vector feature."""

    def __init__(self, features, num_outputs: int):
        super().__init__()
        self.features = features
        self.vector = features.of_type("vector")[0].name
        width = features.numeric_width + features[self.vector].length
        self.linear = nn.Linear(width, num_outputs)

    def forward(self, batch):
        import torch

        return self.linear(torch.cat([batch["numeric"], batch[self.vector]], dim=1))


def dict_model(features, num_outputs: int, scale: int = 1):
    """The current factory form: gets the FeatureSet, returns a module taking the batch dict."""
    model = _FirstFeatureHead(features, num_outputs)
    model.scale = scale
    return model


def dict_not_a_module(features, num_outputs: int):
    return [1, 2]


def embeddings_and_conv(features, num_outputs, width=16):
    """A dict-taking factory: an embedding per categorical feature plus a conv tower over the image feature,
    the numeric block alongside, then a linear head (the form `model.factory` may return)."""
    import torch
    import torch.nn as nn

    class EmbeddingsAndConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.categorical = [f.name for f in features.of_type("categorical")]
            self.image = features.of_type("image")[0]
            self.embeddings = nn.ModuleDict({name: nn.Embedding(features[name].cardinality, 4)
                                             for name in self.categorical})
            self.conv = nn.Sequential(nn.Conv2d(self.image.channels, width, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
            inputs = 4 * len(self.categorical) + width + features.numeric_width
            self.head = nn.Sequential(nn.Linear(inputs, 32), nn.ReLU(), nn.Linear(32, num_outputs))

        def forward(self, batch):
            pixels = batch[self.image.name].float() / 255.0
            parts = [self.embeddings[name](batch[name]) for name in self.categorical]
            parts += [self.conv(pixels), batch["numeric"]]
            return self.head(torch.cat(parts, dim=1))

    return EmbeddingsAndConv()


def bn_mlp(num_features: int, num_outputs: int, width: int = 32):
    """A BatchNorm MLP (running statistics are buffers, the state issue 16 is about)."""
    return nn.Sequential(nn.Linear(num_features, width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, num_outputs))


def bn_stages(num_features: int, num_outputs: int, width: int = 32):
    """bn_mlp as two pipeline stages, each with its own BatchNorm (each stage's buffers are its own)."""
    return [nn.Sequential(nn.Linear(num_features, width), nn.BatchNorm1d(width), nn.ReLU()),
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, num_outputs))]
