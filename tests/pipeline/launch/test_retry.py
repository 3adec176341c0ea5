"""The retry policy decides from the failure account alone: retry from the PS state, retry from the
newest checkpoint, or give up (out of attempts, or a failure another attempt would repeat)."""
from pipeline.errors import WorkerFailure, WorkerTrainingFailedError
from pipeline.launch.retry import FailureAccount, RetryPolicy, Verdict, given_up


def _account(attempt, *failures):
    return FailureAccount(attempt, WorkerTrainingFailedError({f.rank: f for f in failures}, attempt, cause="lost"))


def test_a_curable_failure_is_retried_from_where_the_state_survived():
    lost = WorkerFailure(1, "PSError: rank 1 closed its connection")
    assert RetryPolicy(3, ps_survives=True).decide(_account(1, lost)).verdict is Verdict.RETRY_FROM_PS_STATE
    assert RetryPolicy(3, ps_survives=False).decide(_account(2, lost)).verdict is Verdict.RETRY_FROM_CHECKPOINT


def test_the_last_attempt_gives_up_naming_the_budget():
    decision = RetryPolicy(2, ps_survives=True).decide(_account(2, WorkerFailure(0, "OSError: reset")))
    assert decision.verdict is Verdict.GIVE_UP
    assert decision.reason == "gave up after 2 attempt(s) (train.max_attempts=2)"


def test_a_failure_a_retry_would_repeat_gives_up_at_once_naming_the_rank():
    nan = WorkerFailure(1, "NonFiniteError: rank 1: the loss is NaN at step 6", retryable=False)
    stopped = WorkerFailure(0, "PSError: rank 1 failed", retryable=True)
    account = _account(1, stopped, nan)
    decision = RetryPolicy(3, ps_survives=True).decide(account)
    assert decision.verdict is Verdict.GIVE_UP
    assert "not retried: rank 1 failed with NonFiniteError" in decision.reason
    final = given_up(account.failure, 1, decision)
    assert final.attempt == 1 and final.cause.startswith("lost; not retried")
    assert sorted(final.failures) == [0, 1]
