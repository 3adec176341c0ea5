"""Learning-rate schedules as a function of the applied step, and clipping of an applied gradient.

Why a function of the step and not a stateful scheduler stepped once per update: the server's step is
its version, which jumps on a resume or a retry (a checkpoint, the PS state kept), and allreduce replicas
and average-mode workers count their own local steps. ``factor(step)`` is the closed form of torch's
``SequentialLR([LinearLR, CosineAnnealingLR | StepLR | LinearLR])`` on the same steps (tested equal);
it drives a real ``torch.optim.lr_scheduler.LambdaLR`` whose counter is set to the step before each
update, so every copy (PS, replicas, a resumed server) uses the same rate for the same step.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    import torch

DECAYS = ("none", "cosine", "step", "linear")


@dataclass(frozen=True)
class ScheduleSpec:
    """``train.schedule`` plus the run's total applied steps (known on the driver)."""

    total_steps: int
    warmup_steps: int = 0
    warmup_start_factor: float = 0.01
    decay: str = "none"
    min_lr_factor: float = 0.0
    step_size: int = 100
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ConfigError(f"train.schedule.decay: {self.decay!r} is not one of {', '.join(DECAYS)}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ConfigError(f"train.schedule needs total steps >= 1 and warmup_steps >= 0, got "
                              f"{self.total_steps} / {self.warmup_steps}")

    @property
    def decay_steps(self) -> int:
        """Steps after the warmup (at least 1, so a warmup covering the whole run still decays cleanly)."""
        return max(self.total_steps - self.warmup_steps, 1)

    def factor(self, step: int) -> float:
        """lr multiplier for the update applied at 0-based ``step``."""
        step = max(int(step), 0)
        if step < self.warmup_steps:
            # LinearLR(start_factor, 1.0, total_iters=warmup_steps)
            return self.warmup_start_factor + (1.0 - self.warmup_start_factor) * step / self.warmup_steps
        t = step - self.warmup_steps
        if self.decay == "cosine":  # CosineAnnealingLR(T_max=decay_steps, eta_min=min_lr_factor * lr)
            t = min(t, self.decay_steps)
            return self.min_lr_factor + (1 - self.min_lr_factor) * (1 + math.cos(math.pi * t / self.decay_steps)) / 2
        if self.decay == "linear":  # LinearLR(1.0, min_lr_factor, total_iters=decay_steps)
            return 1.0 + (self.min_lr_factor - 1.0) * min(t, self.decay_steps) / self.decay_steps
        if self.decay == "step":  # StepLR(step_size, gamma)
            return self.gamma ** (t // self.step_size)
        return 1.0


def schedule_spec(cfg, total_steps: int) -> Optional[ScheduleSpec]:
    """The spec of ``cfg.train.schedule`` over ``total_steps`` applied steps, or None when it is constant."""
    s = cfg.train.schedule
    if s.warmup_steps == 0 and s.decay == "none":
        return None
    return ScheduleSpec(total_steps=max(int(total_steps), 1), warmup_steps=s.warmup_steps,
                        warmup_start_factor=s.warmup_start_factor, decay=s.decay, min_lr_factor=s.min_lr_factor,
                        step_size=s.step_size, gamma=s.gamma)


class StepSchedule:
    """A ``LambdaLR`` over ``optimizer`` whose step is set before each update (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, spec: ScheduleSpec) -> None:
        from torch.optim.lr_scheduler import LambdaLR

        self.spec = spec
        self.scheduler = LambdaLR(optimizer, spec.factor)
        # torch warns on a scheduler's first step() before any optimizer.step(); here the counter is set
        # explicitly, so the order does not matter: take that first step now, with the warning silenced.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.at(0)

    def at(self, step: int) -> float:
        """Set the rate of the update applied at ``step``; returns it."""
        # LambdaLR.step() adds one to last_epoch and sets every group to base_lr * factor(last_epoch).
        self.scheduler.last_epoch = int(step) - 1
        self.scheduler.step()
        return self.scheduler.get_last_lr()[0]


def attach_schedule(optimizer, spec: Optional[ScheduleSpec]) -> Optional[StepSchedule]:
    return None if spec is None else StepSchedule(optimizer, spec)


def clip_(params, max_norm: Optional[float]) -> Optional[float]:
    """Clip the gradients of ``params`` to global L2 norm ``max_norm`` (torch's clip_grad_norm_); the norm
    before clipping, or None when clipping is off."""
    if max_norm is None:
        return None
    from torch.nn.utils import clip_grad_norm_

    return float(clip_grad_norm_(params, max_norm))
