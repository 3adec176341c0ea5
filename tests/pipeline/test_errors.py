"""Which failures a retry can cure: the policy's input, decided from the exception alone."""
import pytest

from pipeline.errors import (ConfigError, DataError, ModelInputError, NonFiniteError, PSError, ShardReadError,
                             is_retryable, shard_read_error)


@pytest.mark.parametrize("exc", [ConfigError("model.factory"), DataError("column f1"), NonFiniteError("NaN"),
                                 ModelInputError("shapes"), shard_read_error("bad file", ValueError("corrupt"))])
def test_a_failure_the_same_inputs_would_repeat_is_not_retryable(exc):
    assert not is_retryable(exc)


@pytest.mark.parametrize("exc", [PSError("rank 1 closed its connection"), OSError("reset"), RuntimeError("x"),
                                 shard_read_error("cannot read shard file s0", FileNotFoundError("gone")),
                                 shard_read_error("cannot read shard file s0", TimeoutError("throttled"))])
def test_a_failure_another_attempt_may_not_meet_is_retryable(exc):
    assert is_retryable(exc)


def test_an_io_failure_on_a_shard_is_still_a_data_error_naming_the_file():
    error = shard_read_error("cannot read shard file /x/s0.parquet: gone", OSError("gone"))
    assert isinstance(error, ShardReadError) and isinstance(error, DataError) and "/x/s0.parquet" in str(error)
