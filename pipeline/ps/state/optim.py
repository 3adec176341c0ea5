"""The optimizer the parameter server applies to its flat parameter vector.

The server owns one flat fp32 tensor and steps a real ``torch.optim`` optimizer over ``[flat]``.
SGD (with momentum / weight decay) and Adam are elementwise, so stepping the flat vector is exactly
what stepping each original parameter would do; that is why a flat buffer is safe here and why only
elementwise optimizers are offered.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError
from pipeline.ps.modes.schedule import ScheduleSpec

logger = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class OptimizerSpec:
    """What optimizer the PS runs. Field names mirror the ``train.*`` config keys they come from."""

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    # train.schedule over the applied steps (None: constant lr) and train.clip_grad_norm (None: off).
    schedule: ScheduleSpec | None = None
    clip_grad_norm: float | None = None

    def __post_init__(self) -> None:
        # Validated here so a bad spec fails on the driver before any worker is launched.
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"train.optimizer: {self.name!r} is not supported by the parameter server "
                f"(choose one of {', '.join(OPTIMIZERS)})"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"train.lr must be a finite number > 0, got {self.lr!r}")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise ConfigError(f"train.momentum must be in [0, 1), got {self.momentum!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer betas must be two numbers in [0, 1), got {self.betas!r}")


def build_optimizer(spec: OptimizerSpec, flat: torch.Tensor | list[torch.Tensor]) -> torch.optim.Optimizer:
    """Create the torch optimizer over ``[flat]`` (the server; the caller sets ``flat.grad`` before each
    step) or over a list of tensors (an ``average``-mode worker's local optimizer over its model)."""
    params = [flat] if isinstance(flat, torch.Tensor) else list(flat)
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    return torch.optim.Adam(
        params, lr=spec.lr, betas=tuple(spec.betas), weight_decay=spec.weight_decay
    )


class FusedSGD:
    """``torch.optim.SGD.step()`` for the server's one flat parameter, as the same in-place torch ops
    without the optimizer's per-step Python machinery (param-group scans, state lookups, dispatch).

    Bit-identical to ``_single_tensor_sgd`` (what SGD runs on CPU) by construction: the same ops in
    the same order, the hyperparameters read from the optimizer's param group at every step (so
    ``load_state_dict``/lr changes apply), the momentum buffer kept in ``optimizer.state`` (so
    checkpoints and a fall-back to ``optimizer.step()`` see it). Only built for a plain SGD setup.
    """

    def __init__(self, optimizer: torch.optim.SGD) -> None:
        self.optimizer = optimizer
        self.group = optimizer.param_groups[0]
        self.param = self.group["params"][0]
        self._scales: dict[int, torch.Tensor] = {}  # divisor -> the kernel's grad_scale

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> FusedSGD | None:
        """A fused stepper, or None when the optimizer is not plain single-tensor CPU SGD."""
        if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
            return None
        group = optimizer.param_groups[0]
        if len(group["params"]) != 1 or group["params"][0].device.type != "cpu":
            return None
        if group.get("nesterov") or group.get("maximize") or group.get("foreach") or group.get("fused") \
                or group.get("differentiable"):
            return None
        return cls(optimizer)

    def step(self, param: torch.Tensor, grad: torch.Tensor, divisor: int = 1) -> None:
        """One SGD step of ``param`` (a detached view of the optimizer's parameter) with ``grad / divisor``
        (the server's gradient sum over ``divisor`` ranks; ``grad`` may be left divided or not)."""
        # Read each step: load_state_dict (a restore) replaces the group dicts, and a schedule sets lr there.
        group = self.group = self.optimizer.param_groups[0]
        lr, momentum, dampening, weight_decay = (group["lr"], group["momentum"], group["dampening"],
                                                 group["weight_decay"])
        if isinstance(lr, torch.Tensor) or isinstance(weight_decay, torch.Tensor) or group.get("nesterov") \
                or group.get("maximize"):
            average_(grad, divisor)
            self.optimizer.step()  # a setup the fused path does not mirror
            return
        with torch.no_grad():
            if weight_decay == 0 and dampening == 0 and _ONE_KERNEL is not None:
                self._one_kernel(param, grad, divisor, lr, momentum)
                return
            average_(grad, divisor)
            if weight_decay != 0:
                grad = grad.add(param, alpha=weight_decay)
            buf, first = self._momentum_buffer(param, momentum)
            _ops_step(param, grad, buf, first, lr, momentum, dampening)

    def _momentum_buffer(self, param: torch.Tensor, momentum: float) -> tuple[torch.Tensor | None, bool]:
        """(the momentum buffer in ``optimizer.state``, whether this step is its first: just allocated);
        (None, False) without momentum."""
        if momentum == 0:
            return None, False
        state = self.optimizer.state[self.param]
        buf = state.get("momentum_buffer")
        if buf is None:  # the first step sets it to the (divided) gradient, as torch's SGD does
            state["momentum_buffer"] = torch.empty_like(param)
            return state["momentum_buffer"], True
        return buf, False

    def _one_kernel(self, param: torch.Tensor, grad: torch.Tensor, divisor: int, lr: float, momentum: float) -> None:
        """The division, the momentum update and the step in one pass over the three vectors (torch's fused
        CPU SGD kernel, what ``SGD(fused=True)`` runs) instead of four: on the sync round's tail, 0.34 ms
        against 0.49 ms per update for 4.4 MB with momentum on the 2-core box (``ShardCore.optimizer_step``).

        Only over a prefix of whole ``_BODY`` blocks: the kernel's vectorized body rounds as the separate ops
        of ``step`` do, but its scalar loop over the last elements contracts ``buf * m + g`` into one fused
        multiply-add, so which elements came out different depended on where a tensor ended (a server in
        two slices was no longer bit for bit the server in one). The rest takes the ops. Weight decay and
        dampening take the ops throughout (tests/pipeline/ps/client/test_fastpath.py)."""
        buf, first = self._momentum_buffer(param, momentum)
        body = param.numel() - param.numel() % _BODY
        if body:
            scale = None
            if divisor != 1:
                scale = self._scales.get(divisor)
                if scale is None:
                    scale = self._scales[divisor] = torch.tensor(float(divisor), dtype=torch.float32)
            _ONE_KERNEL([param[:body]], [grad[:body]], [buf[:body]] if buf is not None else [], weight_decay=0.0,
                        momentum=momentum, lr=lr, dampening=0.0, nesterov=False, maximize=False,
                        is_first_step=first, grad_scale=scale, found_inf=None)
        if body < param.numel():
            tail = grad[body:]
            average_(tail, divisor)
            _ops_step(param[body:], tail, buf[body:] if buf is not None else None, first, lr, momentum, 0.0)

# torch's fused SGD kernel (aten::_fused_sgd_, what SGD(fused=True) runs); None on a torch without it.
_ONE_KERNEL = getattr(torch, "_fused_sgd_", None)
# Elements per block of the kernel's vectorized body: a multiple of every SIMD width torch uses (AVX-512: 16).
_BODY = 64


def _ops_step(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, first: bool, lr: float,
              momentum: float, dampening: float) -> None:
    """``_single_tensor_sgd``'s momentum update and step as its torch ops, in its order (``grad`` already
    divided and weight-decayed; ``buf`` None without momentum, ``first``: set it to ``grad``)."""
    if buf is not None:
        if first:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = buf
    param.add_(grad, alpha=-lr)


def average_(grad_sum: torch.Tensor, divisor: int) -> None:
    """``grad_sum /= divisor`` in place."""
    if divisor & (divisor - 1) == 0:  # a power of two: x * 2**-k is x / 2**k bit for bit (subnormals
        if divisor != 1:  # too), and a multiply costs a fraction of a divide on the sync round's tail
            grad_sum.mul_(1.0 / divisor)
    else:
        grad_sum.div_(divisor)
