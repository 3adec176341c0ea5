"""A user model factory, imported by name through `model.factory` in tests."""
import torch.nn as nn


def tiny_mlp(num_features: int, num_outputs: int, width: int = 8):
    return nn.Sequential(nn.Linear(num_features, width), nn.Tanh(), nn.Linear(width, num_outputs))


def not_a_module(num_features: int, num_outputs: int):
    return "nope"
