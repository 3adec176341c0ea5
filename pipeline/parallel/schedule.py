"""The GPipe fill-drain schedule for one pipeline stage.

Each step splits the batch into ``micro_batches`` row blocks, runs every forward (stage 0 feeds
features, later stages receive activations), then every backward in reverse micro-batch order (the last
stage starts from its loss, earlier stages from the activation gradients sent back). The last stage
scales each micro-batch's mean loss by ``micro_rows / batch_rows``, so the gradients accumulated over
the micro-batches equal the gradient of the full batch's mean loss: a pipelined step computes the same
update as an unpipelined one, up to float rounding.

The stage only accumulates ``.grad`` on its module; zeroing gradients, the optimizer step and the PS
exchange of the stage's parameter slice stay with the caller, exactly as around ``loss.backward()``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
import torch.nn as nn

from pipeline.errors import ConfigError, PSError
from pipeline.parallel.link import StageLink

logger = logging.getLogger(__name__)

MICRO_BATCHES_KEY = "parallelism.micro_batches"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def bubble_fraction(idle_s: float, compute_s: float) -> float:
    """Share of a stage's busy-or-waiting time spent waiting: ``idle / (idle + compute)``."""
    total = idle_s + compute_s
    return idle_s / total if total > 0 else 0.0


def split_rows(rows: int, parts: int) -> list[int]:
    """Micro-batch sizes like ``numpy.array_split``: ``parts`` sizes differing by at most one, larger
    first. Every stage derives the same sizes from the same two numbers."""
    if parts < 1:
        raise ConfigError(f"{MICRO_BATCHES_KEY} must be >= 1, got {parts}")
    if parts > rows:
        raise ConfigError(
            f"{MICRO_BATCHES_KEY} is {parts} but the batch has only {rows} row(s), so some micro-batches "
            f"would be empty; lower {MICRO_BATCHES_KEY} or raise the batch size (and drop or pad a short "
            "last batch)"
        )
    base, extra = divmod(rows, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


@dataclass
class StageStats:
    """Time and traffic of one stage over ``steps`` steps (one step from :meth:`GPipeStage.step`).

    ``idle_s`` is time blocked in receives (the pipeline bubble plus network time), ``send_s`` time in
    sends (normally short: frames go into the kernel buffer). ``loss`` is the sum of the steps'
    full-batch mean losses on the last stage and None elsewhere.
    """

    steps: int = 0
    rows: int = 0
    compute_s: float = 0.0
    idle_s: float = 0.0
    send_s: float = 0.0
    bytes_sent: int = 0
    loss: Optional[float] = None

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self.idle_s, self.compute_s)

    @property
    def mean_loss(self) -> Optional[float]:
        return None if self.loss is None or not self.steps else self.loss / self.steps

    def add(self, other: "StageStats") -> None:
        for f in fields(self):
            if f.name == "loss":
                continue
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        if other.loss is not None:
            self.loss = other.loss + (self.loss or 0.0)


class GPipeStage:
    """Runs one stage of a GPipe pipeline, one training step per :meth:`step` call.

    ``prev`` is the link from stage ``stage - 1`` (None on stage 0) and ``next`` the link to stage
    ``stage + 1`` (None on the last stage); the last stage needs ``loss_fn(output, target)`` returning
    the mean loss over its rows. Activations between stages must be 2-D float32 tensors; they travel
    through host memory and received ones are moved to ``device`` (default: where the module's first
    parameter lives). All stages must use the same ``micro_batches``.
    """

    def __init__(self, module: nn.Module, *, stage: int, stages: int, micro_batches: int,
                 prev: Optional[StageLink] = None, next: Optional[StageLink] = None,
                 loss_fn: Optional[LossFn] = None, device: Optional[torch.device] = None) -> None:
        if not 0 <= stage < stages:
            raise ValueError(f"stage {stage} is out of range for {stages} stage(s)")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ConfigError(f"{MICRO_BATCHES_KEY} must be an integer >= 1, got {micro_batches!r}")
        if (prev is None) != (stage == 0):
            raise ValueError(f"stage {stage} needs {'no' if stage == 0 else 'a'} link from the previous stage")
        if (next is None) != (stage == stages - 1):
            raise ValueError(f"stage {stage} needs {'no' if stage == stages - 1 else 'a'} link to the next stage")
        if stage == stages - 1 and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn")
        self.module = module
        self.stage = stage
        self.stages = stages
        self.micro_batches = micro_batches
        self.prev = prev
        self.next = next
        self.loss_fn = loss_fn
        if device is None:
            # ``next`` is the link parameter here, so no builtins.next.
            params = list(module.parameters())
            device = params[0].device if params else torch.device("cpu")
        self.device = device
        self._total = StageStats()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _bytes_sent(self) -> int:
        return sum(link.bytes_sent for link in (self.prev, self.next) if link is not None)

    def step(self, step: int, features: Optional[torch.Tensor] = None,
             labels: Optional[torch.Tensor] = None) -> StageStats:
        """One fill-drain training step; accumulates this stage's gradients and returns its stats.

        Stage 0 passes ``features``, the last stage ``labels`` (both, with a single stage); the rows of
        the batch define the micro-batch sizes. ``step`` must be the same number on every stage: the
        link refuses frames of another step. If the step fails, both links are closed (the neighbours'
        steps fail too) and the stage is unusable: the job restarts the generation.
        """
        try:
            return self._step(step, features, labels)
        except BaseException:
            # The frame stream is out of step now; closing makes the neighbours fail at once with
            # "closed the link" instead of waiting out ps.timeout_s.
            self.close()
            raise

    def _step(self, step: int, features: Optional[torch.Tensor], labels: Optional[torch.Tensor]) -> StageStats:
        if self.is_first and features is None:
            raise ValueError("stage 0 needs the batch features")
        if self.is_last and labels is None:
            raise ValueError(f"the last stage ({self.stage}) needs the batch labels")
        stats = StageStats(steps=1)
        bytes_before = self._bytes_sent()
        feature_parts = label_parts = None
        rows_per_micro: Optional[list[int]] = None
        if features is not None:
            from pipeline.data.batch import batch_rows as rows_of, split_batch

            rows_per_micro = split_rows(rows_of(features), self.micro_batches)
            feature_parts = split_batch(features, rows_per_micro)
        if labels is not None:
            label_rows = split_rows(labels.shape[0], self.micro_batches)
            if rows_per_micro is not None and label_rows != rows_per_micro:
                raise ValueError(f"features have {sum(rows_per_micro)} rows but labels {labels.shape[0]}")
            rows_per_micro = label_rows
            label_parts = torch.split(labels, label_rows)
        batch_rows = sum(rows_per_micro) if rows_per_micro is not None else 0

        inputs: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        loss_total = 0.0
        rows_seen = 0
        for micro in range(self.micro_batches):
            if feature_parts is not None:
                x = feature_parts[micro]
            else:
                assert self.prev is not None
                t0 = time.perf_counter()
                x = self.prev.recv_activation(
                    step, micro, rows=rows_per_micro[micro] if rows_per_micro is not None else None)
                stats.idle_s += time.perf_counter() - t0
                x = x.to(self.device).requires_grad_(True)
            rows_seen += rows_per_micro[micro] if feature_parts is not None else x.shape[0]
            t0 = time.perf_counter()
            y = self.module(x)
            if self.is_last:
                assert label_parts is not None and self.loss_fn is not None
                rows = label_parts[micro].shape[0]
                y = self.loss_fn(y, label_parts[micro]) * (rows / batch_rows)
                loss_total += float(y.detach())
            stats.compute_s += time.perf_counter() - t0
            if not self.is_last:
                if y.dim() != 2 or y.dtype != torch.float32:
                    raise PSError(f"stage {self.stage} outputs shape {tuple(y.shape)} and dtype {y.dtype}; "
                                  "pipeline stages must pass 2-D float32 activations, so cut elsewhere "
                                  "or flatten inside the stage")
                assert self.next is not None
                t0 = time.perf_counter()
                self.next.send_activation(step, micro, y)
                stats.send_s += time.perf_counter() - t0
            inputs.append(x)
            outputs.append(y)

        for micro in reversed(range(self.micro_batches)):
            y = outputs[micro]
            if self.is_last:
                grad = None
            else:
                assert self.next is not None
                t0 = time.perf_counter()
                grad = self.next.recv_grad(step, micro, rows=y.shape[0], cols=y.shape[1]).to(self.device)
                stats.idle_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            y.backward(grad)
            stats.compute_s += time.perf_counter() - t0
            if not self.is_first:
                assert self.prev is not None
                x = inputs[micro]
                # An output that ignores its input still owes the previous stage a gradient frame.
                x_grad = x.grad if x.grad is not None else torch.zeros_like(x)
                t0 = time.perf_counter()
                self.prev.send_grad(step, micro, x_grad)
                stats.send_s += time.perf_counter() - t0

        stats.rows = rows_seen
        stats.bytes_sent = self._bytes_sent() - bytes_before
        stats.loss = loss_total if self.is_last else None
        self._total.add(stats)
        logger.debug("stage %s step %s: compute %.4fs idle %.4fs send %.4fs, %s bytes sent", self.stage, step,
                     stats.compute_s, stats.idle_s, stats.send_s, stats.bytes_sent)
        return stats

    def close(self) -> None:
        """Close both links (idempotent)."""
        for link in (self.prev, self.next):
            if link is not None:
                link.close()

    def take(self) -> StageStats:
        """Totals since the last ``take()`` (or since construction), then start counting afresh."""
        total, self._total = self._total, StageStats()
        return total
