"""One flat fp32 vector per model: the unit the parameter server stores, averages and ships."""
from __future__ import annotations


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def flat_parameters(model):
    """A new contiguous fp32 vector of all parameters, in `model.parameters()` order."""
    import torch

    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in model.parameters()])


def flat_gradients(model, out=None):
    """All gradients in parameter order into one contiguous fp32 vector (zeros where a grad is None).

    Gradients on an accelerator are packed there into one flat vector and copied to ``out`` (host memory
    for the PS) in a single transfer: one small device-to-host copy per tensor would pay a sync and a
    launch each."""
    import torch

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if out is None:
        out = torch.empty(total, dtype=torch.float32)
    devices = {p.grad.device for p in params if p.grad is not None}
    if any(d != out.device for d in devices):
        device = next(iter(d for d in devices if d != out.device))
        flat = torch.cat([p.grad.reshape(-1).to(torch.float32) if p.grad is not None
                          else torch.zeros(p.numel(), dtype=torch.float32, device=device) for p in params])
        out.copy_(flat)
        return out
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            out[offset:offset + n].zero_()
        else:
            out[offset:offset + n].copy_(p.grad.reshape(-1))
        offset += n
    return out


def load_flat_parameters(model, flat) -> None:
    """Copy a flat vector back into the model's parameters (shape checked)."""
    import torch

    total = num_parameters(model)
    if flat.numel() != total:
        raise ValueError(f"flat parameter vector has {flat.numel()} elements, the model has {total}")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n
