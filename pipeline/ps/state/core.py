"""The state of one shard: its slice of the flat fp32 parameters, a real ``torch.optim`` optimizer over
it, the version and generation, and the condition every other part of the shard waits on.

Why one condition for the whole shard: a step, a pull's answer, a failure and a new generation all
change what a waiter may do next, and one lock makes each of those a single moment every waiter sees
whole. The consistency policies, the roster, the failure ledger and the stats are guarded by it too.

Why readers and ``stepping``: PARAMS are sent straight from the parameter tensor (no per-rank snapshot
copy), so an update first waits for in-flight sends to finish, and ``stepping`` keeps new readers (and,
in ssp/async, new pushes) out meanwhile. Each send has its own step deadline, which bounds that wait.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import torch

from pipeline.errors import PSError
from pipeline.ps.transport.connection import RankConnection
from pipeline.ps.server.messages import TIMEOUT, Refusal
from pipeline.ps.state.optim import FusedSGD, average_, build_optimizer
from pipeline.ps.transport.protocol import MsgType
from pipeline.ps.modes.schedule import attach_schedule, clip_
from pipeline.ps.settings import PSSettings
from pipeline.wire.deadline import deadline_after
from pipeline.wire.frames import U32_MAX

logger = logging.getLogger(__name__)


def _page_for(count: int) -> Any:
    from pipeline.wire import shared_page

    if not shared_page.supported():
        return None
    try:
        return shared_page.SharedPage(count)
    except OSError as exc:
        logger.warning("the parameters stay in private memory (local workers get copies): no shared page "
                       "for them (%s)", exc)
        return None


class ShardCore:
    """Parameters, optimizer, version and generation of one shard (see module docstring)."""

    def __init__(self, initial: torch.Tensor, settings: PSSettings, *, generation: int,
                 shared_page: bool = False) -> None:
        if not isinstance(initial, torch.Tensor) or initial.numel() == 0:
            raise PSError("the parameter server needs a non-empty initial parameter tensor")
        if not torch.isfinite(initial).all():
            raise PSError("the initial parameters contain NaN or Inf")
        if not 0 <= generation <= U32_MAX:
            raise PSError(f"generation must fit an unsigned 32-bit field, got {generation}")
        self.cond = threading.Condition(threading.Lock())
        self.step_timeout = settings.step_timeout
        # shared_page (sync mode, workers on this host): the parameters live in a sealed page local workers
        # map copy-on-write (pipeline.wire.shared_page), so a PARAMS reply to them is a header, not a copy.
        self.page = _page_for(initial.numel()) if shared_page else None
        source = initial.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        self.flat = source.clone() if self.page is None else self.page.tensor.copy_(source)
        self.flat.requires_grad_(True)
        self.num_params = self.flat.numel()
        # flat.grad IS the accumulation buffer: pushes sum into it, the step divides it once.
        self.grad_sum = torch.zeros_like(self.flat, requires_grad=False)
        self.flat.grad = self.grad_sum
        self.optimizer_spec = settings.optimizer
        self.optimizer = build_optimizer(settings.optimizer, self.flat)
        self._fused_sgd = FusedSGD.for_optimizer(self.optimizer)
        self._schedule = attach_schedule(self.optimizer, settings.optimizer.schedule)
        self.last_grad_norm: float | None = None  # the applied gradient's norm before clipping

        self.version = 0
        self.generation = generation
        self.abort_reason: str | None = None
        self.closed = False
        self.readers = 0  # PULLs sending straight from the parameter tensor
        self.stepping = False  # an update waits for readers; new readers wait for it
        # Sparse tables (pipeline.ps.sparse.store): called with the version being applied, inside the update.
        self.after_update: Callable[[int], None] | None = None

    # -- updates -----------------------------------------------------------------------------------
    def update_locked(self, apply: Callable[[], None]) -> bool:
        """Run ``apply`` alone on the parameters and bump the version; False if new_generation() or
        close() discarded the update while it waited for in-flight sends."""
        generation = self.generation
        self.stepping = True
        try:
            deadline = time.monotonic() + self.step_timeout.seconds + 1.0
            while self.readers and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)
            if self.readers:  # pragma: no cover - a send outlived its own timeout
                logger.warning("stepping while %s parameter sends are still in flight", self.readers)
            if generation != self.generation or self.closed:
                return False
            apply()
            if self.after_update is not None:
                self.after_update(self.version)
            self.version += 1
            return True
        finally:
            self.stepping = False
            self.cond.notify_all()

    def optimizer_step(self, grad_sum: torch.Tensor, divisor: int) -> None:
        """sync/ssp/async: one optimizer step with ``grad_sum / divisor`` (``grad_sum`` is then spent)."""
        self.flat.grad = grad_sum
        if self._schedule is not None:
            self._schedule.at(self.version)  # the rate of applied step `version`, however it got there
        if self._fused_sgd is not None and self.optimizer_spec.clip_grad_norm is None:
            self.last_grad_norm = None
            self._fused_sgd.step(self.flat.detach(), grad_sum, divisor)  # divides as it steps
            return
        average_(grad_sum, divisor)
        # Clipped here, on the averaged gradient the server applies (train.clip_grad_norm; ps.shards=1).
        self.last_grad_norm = clip_([self.flat], self.optimizer_spec.clip_grad_norm)
        if self._fused_sgd is not None:
            self._fused_sgd.step(self.flat.detach(), grad_sum)
        else:
            self.optimizer.step()

    def add_mean_delta(self, delta_sum: torch.Tensor, divisor: int) -> None:
        """average: the sum holds parameter deltas, so ``flat += sum / divisor`` (no server optimizer)."""
        with torch.no_grad():
            self.flat.add_(delta_sum, alpha=1.0 / divisor)

    def wait_not_stepping_locked(self, what: str) -> None:
        """ssp/async: a push must not touch the sums while an update is being applied."""
        deadline = deadline_after(self.step_timeout)
        while self.stepping:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refusal(self.step_timeout.message(f"the previous update to be applied before {what}"),
                              kind=TIMEOUT)
            self.cond.wait(left)

    # -- reads -------------------------------------------------------------------------------------
    def begin_read_locked(self, conn: RankConnection) -> int:
        """Register a PARAMS send of the current version; the next update waits until it is done."""
        conn.pulled_version = self.version
        self.readers += 1
        return self.version

    def send_params(self, conn: RankConnection, version: int) -> None:
        """Send straight from the flat tensor, or only say which version the shared page holds (a worker
        that mapped it); releases the reader ``begin_read_locked`` registered."""
        try:
            if conn.params_in_page:
                conn.channel.send_empty(MsgType.PARAMS_SHARED, generation=conn.generation, rank=conn.rank,
                                        step=version, timeout=self.step_timeout.seconds)
            else:
                conn.channel.send_tensor(MsgType.PARAMS, self.flat.detach(), generation=conn.generation,
                                         rank=conn.rank, step=version, timeout=self.step_timeout.seconds)
        finally:
            with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    def parameters(self) -> torch.Tensor:
        """A copy of the flat fp32 parameters (consistent: taken under the step lock)."""
        with self.cond:
            return self.flat.detach().clone()

    # -- checkpoints -------------------------------------------------------------------------------
    def state_locked(self) -> dict[str, Any]:
        """Version, parameters and optimizer (deep copies, plain types only, so checkpoints of it load
        with weights-only loading)."""
        return {
            "version": self.version,
            "params": self.flat.detach().clone(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "optimizer_spec": dataclasses.asdict(self.optimizer_spec),
        }

    def check_restorable(self, state: dict[str, Any]) -> None:
        params = state["params"]
        if not isinstance(params, torch.Tensor) or params.numel() != self.num_params:
            raise PSError(f"checkpoint parameters do not match the server's {self.num_params} parameters")
        saved_name = dict(state.get("optimizer_spec") or {}).get("name", self.optimizer_spec.name)
        if saved_name != self.optimizer_spec.name:
            raise PSError(f"checkpoint was trained with optimizer {saved_name!r} but train.optimizer is "
                          f"{self.optimizer_spec.name!r}; resume with the same optimizer")

    def restore_locked(self, state: dict[str, Any]) -> None:
        """Parameters, optimizer state and version of a ``check_restorable`` state. The optimizer's
        hyperparameters stay this server's (the current config wins over the checkpoint's lr/...)."""
        with torch.no_grad():
            self.flat.copy_(state["params"].reshape(-1).to(torch.float32))
        self.optimizer.load_state_dict(state["optimizer"])
        group = self.optimizer.param_groups[0]
        spec = self.optimizer_spec
        group.update(lr=spec.lr, weight_decay=spec.weight_decay)
        if spec.name == "sgd":
            group["momentum"] = spec.momentum
        else:
            group["betas"] = tuple(spec.betas)
        self.version = int(state["version"])
