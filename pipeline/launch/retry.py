"""Driver side: what to do after a failed barrier attempt, decided by one policy from the failure account.

Spark never retries a failed barrier ResultStage; the driver's attempt loop does. Whether another attempt
can help depends on the failure: a NaN/Inf loss or gradient, a config or data error, or a model that
raises on its input would fail the same way again, so those end the run at once; anything else (a killed
task, a lost connection, a stuck rank) is retried until train.max_attempts — from the PS state where it
survived the attempt intact, else from this run's newest checkpoint, else (allreduce, whose state lives
only in the replicas) from the start.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pipeline.errors import WorkerTrainingFailedError


class StateAfterFailure(enum.Enum):
    """What training state a failed attempt left, as the placement reports it."""

    KEPT = "the PS state, intact"  # the PS outlived the attempt and its members agree
    CHECKPOINT = "only the newest checkpoint"  # the PS died with its task, or its members disagree
    NONE = "nothing"  # allreduce: the state lived in the replicas


class Verdict(enum.Enum):
    RETRY_FROM_PS_STATE = "retry from the PS state"
    RETRY_FROM_CHECKPOINT = "retry from the newest checkpoint"
    RETRY_FROM_START = "retry from the start"
    GIVE_UP = "give up"


_RETRY = {StateAfterFailure.KEPT: Verdict.RETRY_FROM_PS_STATE,
          StateAfterFailure.CHECKPOINT: Verdict.RETRY_FROM_CHECKPOINT,
          StateAfterFailure.NONE: Verdict.RETRY_FROM_START}


@dataclass(frozen=True)
class FailureAccount:
    """One failed attempt as the policy sees it: the failure and what state it left."""

    attempt: int
    failure: WorkerTrainingFailedError
    state: StateAfterFailure

    @property
    def incurable(self) -> dict[int, str]:
        """Root-cause ranks whose failure a retry would replay: {rank: error}."""
        return {rank: f.error for rank, f in self.failure.failures.items() if not f.retryable}


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``max_attempts`` barrier attempts (train.max_attempts)."""

    max_attempts: int

    def decide(self, account: FailureAccount) -> Decision:
        incurable = account.incurable
        if incurable:
            rank, error = next(iter(incurable.items()))
            return Decision(Verdict.GIVE_UP, f"not retried: rank {rank} failed with {_kind(error)}, which another "
                                             "attempt would repeat (a NaN/Inf loss or gradient, a config or data "
                                             "error, or a model that rejects its input)")
        if account.attempt >= self.max_attempts:
            return Decision(Verdict.GIVE_UP, f"gave up after {account.attempt} attempt(s) "
                                             f"(train.max_attempts={self.max_attempts})")
        return Decision(_RETRY[account.state], f"the attempt left {account.state.value}")


def _kind(error: str) -> str:
    """The exception type a row's error names ("stage 1 of 2 (replica 0): ModelInputError: ...")."""
    found = re.search(r"\b([A-Z]\w*(?:Error|Exception))\b", error)
    return found.group(1) if found else "an error"


def given_up(failure: WorkerTrainingFailedError, attempt: int, reason: str) -> WorkerTrainingFailedError:
    """The exception the run ends with: the attempt's failure, its cause extended by why it ends here."""
    cause = f"{failure.cause + '; ' if failure.cause else ''}{reason}"
    return WorkerTrainingFailedError(failure.failures, attempt, cause, failure.stopped)
