"""A user loss factory, imported by name through `model.loss` in tests."""
import torch


def scaled_l1(task, num_classes, scale=1.0):
    assert task == "regression" and num_classes is None

    def loss(output, target):
        return scale * torch.mean(torch.abs(output - target))

    return loss
