"""Mixed precision for one worker (``train.precision``): autocast for the forward, and with fp16 a
GradScaler, so small gradients survive the half-precision backward.

bf16 has fp32's exponent range, so it needs no scaling and runs on CPU and GPU alike. fp16 needs CUDA
(CPU fp16 autocast is slow and partial); it is refused on a CPU worker with the key to change.

Where the scaler meets the parameter server: a rank pushes gradients, the server steps. The push is
unscaled first (the server must see true gradients, and every rank's scale is its own); a push whose
unscaled gradient overflowed is sent as zeros (the server never applies an inf; this is the step the
GradScaler would have skipped), and the scale backs off as usual. Local optimizers (average mode,
allreduce) use the scaler's own unscale_/step/update.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING, Optional

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")


class Precision:
    """Autocast + (fp16) GradScaler for a model on ``device``. ``allow_cpu_fp16`` is for tests only."""

    def __init__(self, mode: str = "fp32", device: str = "cpu", *, allow_cpu_fp16: bool = False) -> None:
        import torch

        if mode not in PRECISIONS:
            raise ConfigError(f"train.precision: {mode!r} is not one of {', '.join(PRECISIONS)}")
        self.mode = mode
        self.device_type = torch.device(device).type
        if mode == "fp16" and self.device_type != "cuda" and not allow_cpu_fp16:
            raise ConfigError("train.precision=fp16 needs a CUDA device (this worker runs on "
                              f"{device}); use train.precision=bf16 on CPU, or fp32")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
        self.scaler = torch.amp.GradScaler(self.device_type) if mode == "fp16" else None
        self._holder: Optional[torch.optim.Optimizer] = None  # what unscale_ records a push's infs against
        self.skipped = 0  # pushes sent as zeros because the unscaled gradient overflowed

    @property
    def scaled(self) -> bool:
        return self.scaler is not None

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        import torch

        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    # -- a push to the parameter server --------------------------------------------------------------
    def unscale_for_push(self, model) -> bool:
        """Unscale ``model``'s gradients in place; False when they overflowed (the caller pushes zeros).
        fp32/bf16: nothing to do, True."""
        if self.scaler is None:
            return True
        import torch

        if self._holder is None:
            # Never stepped: GradScaler.unscale_ wants an optimizer to record the step's infs against.
            self._holder = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        self.scaler.unscale_(self._holder)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = bool(torch.isfinite(torch.stack([g.abs().max() for g in grads])).all()) if grads else True
        self.scaler.update()
        if not finite:
            self.skipped += 1
            log.debug("fp16 gradient overflow: pushing zeros, scale now %g", self.scaler.get_scale())
        return finite

    # -- a local optimizer -----------------------------------------------------------------------------
    def unscale_(self, optimizer) -> None:
        """Before clipping: gradients back to their true size (fp16 only)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> None:
        """optimizer.step(), or with fp16 the scaler's step (skipped on inf) and update."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()


class LocalOptimizer:
    """A worker's own optimizer (average mode, allreduce): the schedule's rate for the step, the scaler's
    unscale, clipping by global norm, then the step — the same on every replica for the same step."""

    def __init__(self, spec, params, precision: Optional[Precision] = None) -> None:
        from pipeline.ps.state.optim import build_optimizer
        from pipeline.ps.modes.schedule import attach_schedule

        self.params = [p for p in params]
        self.optimizer = build_optimizer(spec, self.params)
        self.schedule = attach_schedule(self.optimizer, spec.schedule)
        self.clip = spec.clip_grad_norm
        self.precision = precision or Precision()
        self.last_grad_norm: Optional[float] = None

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, step: int) -> None:
        from pipeline.ps.modes.schedule import clip_

        if self.schedule is not None:
            self.schedule.at(step)
        self.precision.unscale_(self.optimizer)
        self.last_grad_norm = clip_(self.params, self.clip)
        self.precision.step(self.optimizer)
