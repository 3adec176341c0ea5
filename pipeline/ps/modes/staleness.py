"""Staleness-aware updates for ``ps.mode`` async and ssp: how much a stale gradient counts, and how much
server momentum is left once asynchrony's own momentum is accounted for.

Why: a gradient computed on parameters ``s`` versions old points where the model was, not where it is;
applied at full weight together with server momentum 0.9 it overshoots, and on the digits defaults
(lr 0.05, momentum 0.9, 2 workers) async runs collapsed to chance in 4 of 7 tries. Two documented rules:

* **Scale** (``ps.staleness_scale``, Zhang et al. 2016, "Staleness-aware async-SGD"): ``inverse`` weighs
  each gradient by ``1 / (1 + s)`` where ``s`` = the server version it is applied to (async) or the clock
  it belongs to (ssp) minus the version the rank pulled before computing it. SGD: the gradient itself is
  scaled, so its whole contribution (momentum included) is ``lr / (1 + s)``. Adam normalizes gradient
  magnitudes, so there the step's learning rate is scaled instead. With ``W`` workers at even speed an
  async gradient is ``W - 1`` versions stale, so each counts ``1 / W``: the same weight per gradient as
  sync's average of ``W``. ``none`` applies every gradient at full weight.
* **Momentum** (``ps.async_momentum``, Mitliagkas et al. 2016, "Asynchrony begets momentum"): asynchrony
  with mean staleness ``tau`` behaves like momentum ``tau / (1 + tau)`` on top of the optimizer's. Null
  (the default) keeps the total where ``train.momentum`` puts it: the server runs
  ``max(0, train.momentum - tau / (1 + tau))`` with ``tau = W - 1`` in async and
  ``tau = min(ps.staleness, W - 1)`` in ssp (the staleness a clock's gradients see at even speed, capped
  by the bound). A number sets the server momentum of async/ssp as it is.

``sync`` and ``average`` are untouched: their gradients are never stale.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from pipeline.errors import PSError

if TYPE_CHECKING:
    import torch

    from pipeline.ps.state.optim import OptimizerSpec

SCALES = ("inverse", "none")
SCALE_KEY = "ps.staleness_scale"
STALE_MODES = ("async", "ssp")


def check_scale(rule: str) -> None:
    if rule not in SCALES:
        raise PSError(f"{SCALE_KEY}: {rule!r} is not one of {', '.join(SCALES)}")


def weight(rule: str, staleness: int) -> float:
    """How much a gradient ``staleness`` versions old counts (1.0 = full weight)."""
    if rule == "none" or staleness <= 0:
        return 1.0
    return 1.0 / (1.0 + staleness)


def implied_staleness(mode: str, world_size: int, bound: int = 0) -> int:
    """The mean staleness ``tau`` a mode implies at even worker speed (0 for sync/average)."""
    if mode == "async":
        return max(world_size - 1, 0)
    if mode == "ssp":
        return min(bound, max(world_size - 1, 0))
    return 0


def implicit_momentum(tau: float) -> float:
    """The momentum asynchrony with mean staleness ``tau`` implies (Mitliagkas et al. 2016)."""
    return tau / (1.0 + tau) if tau > 0 else 0.0


def server_momentum(momentum: float, mode: str, world_size: int, bound: int = 0,
                    override: Optional[float] = None) -> float:
    """The SGD momentum the server runs: ``override`` if set (async/ssp), else ``momentum`` less the
    momentum asynchrony already implies, never below 0. sync/average keep ``momentum``."""
    if mode not in STALE_MODES:
        return momentum
    if override is not None:
        return float(override)
    return max(0.0, momentum - implicit_momentum(implied_staleness(mode, world_size, bound)))


def server_optimizer(spec: OptimizerSpec, mode: str, world_size: int, bound: int = 0,
                     override: Optional[float] = None) -> OptimizerSpec:
    """``spec`` with the server momentum of ``mode`` (only SGD has a momentum to correct)."""
    if spec.name != "sgd":
        return spec
    return dataclasses.replace(spec, momentum=server_momentum(spec.momentum, mode, world_size, bound, override))


def scaled_step(core, grad: torch.Tensor, divisor: int, scale: float) -> None:
    """``core.optimizer_step(grad, divisor)`` with this update weighted by ``scale`` (see module docstring:
    the gradient for SGD, the step's learning rate otherwise)."""
    if scale == 1.0:
        core.optimizer_step(grad, divisor)
        return
    group = core.optimizer.param_groups[0]
    if core.optimizer_spec.name == "sgd":
        grad.mul_(scale)
        core.optimizer_step(grad, divisor)
        return
    lr = group["lr"]
    group["lr"] = lr * scale
    try:
        core.optimizer_step(grad, divisor)
    finally:
        group["lr"] = lr
