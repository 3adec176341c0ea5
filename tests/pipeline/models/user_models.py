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
