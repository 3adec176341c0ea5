"""The exception types shardline users see.

Every error says what went wrong, names the thing involved (config key, file, column, rank) and, where
there is one, the knob or action that fixes it.
"""
from __future__ import annotations

from dataclasses import dataclass


class ShardlineError(Exception):
    """Base class of every error shardline raises on purpose."""


class ConfigError(ShardlineError):
    """A config file, key or value is invalid. The message names the key."""


class DataError(ShardlineError):
    """Input data is unusable: missing column, bad values, empty split. Names file/column/count."""


class ShardReadError(DataError):
    """A shard file could not be read because of I/O (a lost mount, storage throttling): unlike a corrupt or
    mismatched file, another attempt may read it, so it is retried."""


def shard_read_error(message: str, exc: BaseException) -> DataError:
    """The DataError for a failed shard read: ShardReadError when the cause was I/O (OSError)."""
    return ShardReadError(message) if isinstance(exc, OSError) else DataError(message)


class ManifestError(DataError):
    """A shard manifest is missing, unreadable or does not match the shards on disk."""


class TableError(DataError):
    """A Delta or Iceberg table cannot be read or written as asked: a version, snapshot or time it does not
    have, a path that is not a table, an unknown catalog, a feature its reader cannot honour. Names the
    table and the fix; nothing was written."""


class PSError(ShardlineError):
    """The parameter server refused a request or failed a step."""


class PSTimeoutError(PSError):
    """A parameter-server wait ran past its deadline. The message names what was awaited and the key."""


class ProtocolError(PSError):
    """A peer sent a frame that does not follow the wire protocol (bad magic, size, type, auth)."""


class AuthenticationError(ProtocolError):
    """The HMAC challenge-response failed: the peer does not hold this run's secret."""


class NonFiniteError(PSError):
    """A loss or gradient held NaN/Inf. A retry would replay the same numbers, so it is not retried."""


class DivergedError(ShardlineError):
    """Training diverged (a non-finite loss, or a loss over train.divergence.factor x the best epoch's) and
    train.divergence.on_divergence is ``fail``; the MLflow run is tagged shardline.diverged first."""


class ModelInputError(ShardlineError):
    """The model (built-in or a model.factory's) raised on its input batch; a retry would too."""


# Failures a retry cannot cure: the same config, data and model fail the same way again.
NOT_RETRYABLE = (ConfigError, DataError, NonFiniteError, ModelInputError)


def is_retryable(exc: BaseException) -> bool:
    """Whether another barrier attempt could succeed where this failure happened."""
    return isinstance(exc, ShardReadError) or not isinstance(exc, NOT_RETRYABLE)


@dataclass(frozen=True)
class WorkerFailure:
    """What one failed worker reported (or what the driver learned about it)."""

    rank: int
    error: str
    log_tail: str = ""
    # False when another attempt would fail the same way (errors.is_retryable of the rank's exception).
    retryable: bool = True


class WorkerTrainingFailedError(ShardlineError):
    """One or more barrier tasks failed. Carries {rank: WorkerFailure} with each rank's log tail."""

    def __init__(self, failures: dict[int, WorkerFailure], attempt: int = 1, cause: str = "",
                 stopped: dict[int, str] | None = None, server_error: str = ""):
        self.failures = dict(sorted(failures.items()))
        self.attempt = attempt
        self.cause = cause
        # What failed on the server's side and took the ranks down (ps.server_processes: a dead shard process).
        self.server_error = server_error
        # Ranks that did not fail themselves but stopped because of the failures above: {rank: why}.
        self.stopped = dict(sorted((stopped or {}).items()))
        super().__init__(self._render())

    def _render(self) -> str:
        ranks = ", ".join(str(r) for r in self.failures) or "unknown"
        lines = [f"training failed on rank(s) {ranks} (attempt {self.attempt})"]
        if self.server_error:  # first: it is the cause, and reports cut long texts at the end
            lines.append(f"--- the parameter server: {self.server_error}")
        for rank, failure in self.failures.items():
            lines.append(f"--- rank {rank}: {failure.error}")
            if failure.log_tail:
                lines.append(f"    last log lines of rank {rank}:")
                lines.extend("    | " + line for line in failure.log_tail.rstrip().splitlines())
        for rank, why in self.stopped.items():
            lines.append(f"--- rank {rank} stopped: {why}")
        if self.cause:
            lines.append(f"--- Spark reported: {self.cause}")
        return "\n".join(lines)
