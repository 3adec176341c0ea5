"""The model's buffers on the parameter server (BatchNorm running statistics and any other persistent
buffer; ``pipeline.models.state`` has the encoding and the merge rule).

Why the server keeps buffers apart from the parameters: buffers are not trained by gradients, so they
never enter the optimizer's vector. Each replica keeps its own buffers while it trains (they only change
its own forward passes) and sends them at its sync points — every epoch end, the last one being the end of
training — where the server keeps each rank's latest copy. The merged buffers (what checkpoints, the
final model and a new attempt's workers get) are ``merge_buffers`` of those copies: floating-point
buffers averaged over the replicas, integer buffers (``num_batches_tracked``) taken from the lowest rank.
Until a rank has reported, the merged buffers are the base: the initial model's, or a checkpoint's.
The server knows no model: the merge is handed in (``functools.partial(merge_buffers, layout)``) by
whoever built the model, and the server only checks word counts.

A new attempt (generation) folds the reports into the base, so its workers start from the merged buffers
of the last epoch end the old attempt reached and no stale rank copy outlives it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from pipeline.errors import PSError

if TYPE_CHECKING:  # torch stays out of module import time
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferSpec:
    """ps.server_processes: what shard 0's child needs of the store, the base buffers (a PULL_BUFFERS'
    answer); reports travel back to the driver's store, which keeps the merge rule (the model's)."""

    base: torch.Tensor


class BufferMirror:
    """Shard 0's buffers in its child process: answers PULL_BUFFERS from the base the driver set, and
    hands each rank's BUFFERS report to ``forward`` (the events pipe to the driver's store), counting them."""

    def __init__(self, spec: BufferSpec, forward: Callable[[int, torch.Tensor], None]) -> None:
        self._base = spec.base.reshape(-1).clone()
        self.words = self._base.numel()
        self._forward = forward
        self._lock = threading.Lock()
        self.forwarded = 0

    def report(self, rank: int, words: torch.Tensor) -> None:
        if words.numel() != self.words:
            raise PSError(f"rank {rank} sent {words.numel()} buffer words, the model has {self.words}")
        with self._lock:  # counted in send order: the driver waits for this many before reading merged()
            self._forward(rank, words.detach().reshape(-1).clone())
            self.forwarded += 1

    def start(self) -> torch.Tensor:
        with self._lock:
            return self._base.clone()

    def set_base(self, words: torch.Tensor) -> None:
        """The driver folded or restored its store (no rank is reporting then): counts start again."""
        with self._lock:
            self._base = words.reshape(-1).clone()
            self.forwarded = 0


class BufferStore:
    """Per-rank buffer reports and their merge, for one server (shard 0 of a ParameterServer)."""

    def __init__(self, initial: torch.Tensor, merge: Callable[[Mapping[int, torch.Tensor]], torch.Tensor]) -> None:
        import torch

        base = initial.detach().reshape(-1).to("cpu")
        self.words = base.numel()
        self._merge = merge
        if base.dtype is not torch.float32 or not self.words:
            raise PSError(f"initial buffers must be a non-empty fp32 word vector, got {base.numel()} {base.dtype}")
        self._base = base.clone()
        self._reports: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def report(self, rank: int, words: torch.Tensor) -> None:
        """This rank's buffers now (copied: ``words`` may alias a receive buffer)."""
        if words.numel() != self.words:
            raise PSError(f"rank {rank} sent {words.numel()} buffer words, the model has {self.words}")
        with self._lock:
            self._reports[rank] = words.detach().reshape(-1).clone()

    def merged(self) -> torch.Tensor:
        """The merged buffers (a new tensor): the reports merged, or the base before any report."""
        with self._lock:
            reports = dict(self._reports)
            if not reports:
                return self._base.clone()
        merged = self._merge(reports)
        if merged.numel() != self.words:
            raise PSError(f"the buffer merge returned {merged.numel()} words, expected {self.words}")
        return merged

    def start(self) -> torch.Tensor:
        """What a rank starts an attempt from (a new tensor): the base — the initial or a checkpoint's
        buffers, or those merged when the previous attempt ended — never another rank's report of this
        attempt. In async mode one rank can finish before another connects; starting from its report
        would count its batches twice in integer buffers (num_batches_tracked) and mix its statistics in."""
        with self._lock:
            return self._base.clone()

    @property
    def reported_ranks(self) -> set[int]:
        with self._lock:
            return set(self._reports)

    def fold(self) -> None:
        """A new attempt: the merged buffers become the base, the reports are cleared."""
        merged = self.merged()
        with self._lock:
            self._base, self._reports = merged, {}

    def restore(self, words: torch.Tensor) -> None:
        """A checkpoint's merged buffers as the base (reports cleared)."""
        import torch

        words = words.detach().reshape(-1).to("cpu")
        if words.dtype is not torch.float32 or words.numel() != self.words:
            raise PSError(f"checkpoint buffers hold {words.numel()} {words.dtype} values, the model's buffers take "
                          f"{self.words} fp32 words; the model changed: start without --resume")
        with self._lock:
            self._base, self._reports = words.clone(), {}
