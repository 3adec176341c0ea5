"""Failure bookkeeping: which ranks failed on a shard, which of those were only the fallout of an
earlier failure, and the board that gives every shard of a server the same verdict.

Why root causes and consequences are told apart: when one worker dies its peers fail too (their
connections drop, their waits are refused), and a report must name the rank that started it. The first
failure in arrival order is the cause; a failure that follows another rank's failure, or the server's
abort, is marked a consequence.

Why a board: a rank's failure seen by one shard must release the waiters of every shard at once, with
one verdict decided once, in arrival order, so a report names the same root cause whichever shard saw
it first. Shards on other hosts would need this over the wire; today all shards live in one process.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from pipeline.errors import WorkerFailure

logger = logging.getLogger(__name__)

# Called as sink(failure, consequence, generation) instead of recording locally; it records on every shard.
FailureSink = Callable[[WorkerFailure, bool, int], None]
# Observes each failed rank once, in arrival order: on_failure(failure, consequence).
FailureObserver = Callable[[WorkerFailure, bool], None]


@dataclass
class FailureLedger:
    """One shard's failed ranks (guarded by the shard's condition). The first record of a rank wins."""

    failures: dict[int, WorkerFailure] = field(default_factory=dict)
    consequences: set[int] = field(default_factory=set)  # failed only after another failure or an abort

    def record_locked(self, failure: WorkerFailure, consequence: bool) -> bool:
        if failure.rank in self.failures:
            return False
        self.failures[failure.rank] = failure
        if consequence:
            self.consequences.add(failure.rank)
        return True

    def root_failures_locked(self) -> dict[int, WorkerFailure]:
        return {r: f for r, f in self.failures.items() if r not in self.consequences}

    def clear_locked(self) -> None:
        self.failures.clear()
        self.consequences.clear()

    def describe_locked(self) -> tuple[str, str]:
        """("1, 3", "rank 1: ...; rank 3: ...") for refusal texts."""
        ranks = ", ".join(str(r) for r in sorted(self.failures))
        parts = "; ".join(f"rank {r}: {f.error}" for r, f in sorted(self.failures.items()))
        return ranks, parts


def drop_text(rank: int, what: str, *, last_step: int | None, earlier: list[int],
              aborted: str | None) -> tuple[str, bool]:
    """The failure text of a rank that dropped before FINISH and whether it is a consequence: a drop
    after peers failed, or after the server aborted, points at that cause instead."""
    text = f"rank {rank} {what} (last pushed step: {last_step})"
    if earlier:
        text += f", after rank(s) {', '.join(map(str, earlier))} had failed"
    elif aborted:
        text += f", after the server aborted: {aborted}"
    return text, bool(earlier or aborted)


class FailureMirror(Protocol):
    """What the board needs of a shard: record a failure decided elsewhere and wake its waiters."""

    def mark_failure(self, failure: WorkerFailure, consequence: bool, generation: int) -> bool: ...


class FailureBoard:
    """One verdict per failed rank for all shards of a server (see module docstring)."""

    def __init__(self, on_failure: FailureObserver | None = None) -> None:
        self._lock = threading.Lock()
        self._shards: list[FailureMirror] = []
        self._failed: set[int] = set()
        self._on_failure = on_failure

    def attach(self, shards: Sequence[FailureMirror]) -> None:
        self._shards = list(shards)

    def reset(self) -> None:
        with self._lock:
            self._failed.clear()

    def __call__(self, failure: WorkerFailure, consequence: bool, generation: int) -> None:
        with self._lock:
            if failure.rank in self._failed:
                return
            # A failure that follows another rank's (on any shard) is that failure's fallout.
            consequence = consequence or bool(self._failed)
            self._failed.add(failure.rank)
        if self._on_failure is not None:  # in arrival order, before any waiter is released
            try:
                self._on_failure(failure, consequence)
            except Exception:  # an observer must not stop the failure from being recorded
                logger.exception("on_failure callback failed for rank %s", failure.rank)
        # Never holds the board's lock while taking a shard's lock: no lock-order cycle.
        for shard in self._shards:
            shard.mark_failure(failure, consequence, generation)
