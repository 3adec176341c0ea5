"""A shard that cannot be read: I/O is retried by the driver, a corrupt file is not."""
import pytest

from pipeline.data.rowgroups import row_groups
from pipeline.errors import DataError, ShardReadError, is_retryable


def test_a_missing_shard_is_an_io_failure_a_retry_may_cure(tmp_path):
    missing = str(tmp_path / "gone.parquet")
    with pytest.raises(ShardReadError, match="cannot read shard file .*gone.parquet") as info:
        row_groups([missing])
    assert is_retryable(info.value)


def test_a_corrupt_shard_is_a_data_error_a_retry_would_repeat(tmp_path):
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 not really parquet PAR1")
    with pytest.raises(DataError, match="cannot read shard file .*corrupt.parquet") as info:
        row_groups([str(corrupt)])
    assert not isinstance(info.value, ShardReadError) and not is_retryable(info.value)
