"""The retry policy decides from the failure account alone: retry from the PS state, from the newest
checkpoint or from the start, or give up (out of attempts, or a failure another attempt would repeat)."""
import pytest

from pipeline.errors import WorkerFailure, WorkerTrainingFailedError
from pipeline.launch.retry import FailureAccount, RetryPolicy, StateAfterFailure, Verdict, given_up

LOST = WorkerFailure(1, "PSError: rank 1 closed its connection")


def _account(attempt, *failures, state=StateAfterFailure.KEPT):
    return FailureAccount(attempt, WorkerTrainingFailedError({f.rank: f for f in failures}, attempt, cause="lost"),
                          state)


@pytest.mark.parametrize("state, verdict", [(StateAfterFailure.KEPT, Verdict.RETRY_FROM_PS_STATE),
                                            (StateAfterFailure.CHECKPOINT, Verdict.RETRY_FROM_CHECKPOINT),
                                            (StateAfterFailure.NONE, Verdict.RETRY_FROM_START)])
def test_a_curable_failure_is_retried_from_the_state_it_left(state, verdict):
    assert RetryPolicy(3).decide(_account(1, LOST, state=state)).verdict is verdict


def test_the_last_attempt_gives_up_naming_the_budget():
    decision = RetryPolicy(2).decide(_account(2, WorkerFailure(0, "OSError: reset")))
    assert decision.verdict is Verdict.GIVE_UP
    assert decision.reason == "gave up after 2 attempt(s) (train.max_attempts=2)"


def test_a_failure_a_retry_would_repeat_gives_up_at_once_naming_the_rank():
    nan = WorkerFailure(1, "stage 1 of 2 (replica 0): NonFiniteError: the loss is NaN at step 6", retryable=False)
    stopped = WorkerFailure(0, "PSError: rank 1 failed", retryable=True)
    account = _account(1, stopped, nan)
    decision = RetryPolicy(3).decide(account)
    assert decision.verdict is Verdict.GIVE_UP
    assert "not retried: rank 1 failed with NonFiniteError" in decision.reason
    final = given_up(account.failure, 1, decision.reason)
    assert final.attempt == 1 and final.cause.startswith("lost; not retried")
    assert sorted(final.failures) == [0, 1]
