"""The requests a shard serves and the replies it sends, as types (after Horovod's request/response
classes in ``spark/driver/driver_service.py``): a handler reads one request off the wire, returns one
reply or raises a :class:`Refusal`, which reaches the worker as an ERROR frame of its ``kind``
(``pipeline.wire.handshake.send_refusal``, the same frame a refused handshake gets).

Why refusals have kinds: the client turns each kind into its own exception (``PSClient._refusal``),
so a worker can tell a deadline from a protocol error from a NaN it would only replay on retry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from pipeline.ps.modes.compression import Contribution

# ERROR frame kinds (the ``kind`` field the client maps to an exception type).
ERROR = "error"
TIMEOUT = "timeout"
PROTOCOL = "protocol"
AUTH = "auth"
NONFINITE = "nonfinite"

MAX_ERROR_CHARS = 64 * 1024
MAX_LOG_TAIL_CHARS = 256 * 1024


class Refusal(Exception):
    """A request answered with an ERROR frame; the connection stays usable."""

    def __init__(self, message: str, kind: str = ERROR) -> None:
        super().__init__(message)
        self.kind = kind


# -- requests (client -> server) ---------------------------------------------------------------------
@dataclass(frozen=True)
class PushRequest:
    """PUSH: this rank's gradient (or, in average mode, parameter delta) for ``step``."""

    step: int
    contribution: Contribution


@dataclass(frozen=True)
class PushPullRequest:
    """PUSH_PULL: PUSH(step) answered with the PARAMS a PULL(step + 1) would get."""

    step: int
    contribution: Contribution


@dataclass(frozen=True)
class PullRequest:
    """PULL: the number the rank waits for (a version in sync/async, the clock to start in ssp)."""

    wanted: int


@dataclass(frozen=True)
class MetricsRequest:
    step: int
    metrics: dict[str, Any]  # a worker's JSON object, handed to on_metrics as it came


@dataclass(frozen=True)
class FailRequest:
    step: int
    error: str
    log_tail: str
    # False when the worker knows another attempt would fail the same way (errors.is_retryable).
    retryable: bool = True


@dataclass(frozen=True)
class FinishRequest:
    step: int


@dataclass(frozen=True)
class BuffersRequest:
    """BUFFERS: this rank's model buffers as fp32 words (``pipeline.models.state``), at a sync point."""

    step: int
    words: Any  # torch.Tensor, a copy owned by the request


@dataclass(frozen=True)
class PullBuffersRequest:
    step: int


Request = Union[PushRequest, PushPullRequest, PullRequest, MetricsRequest, FailRequest, FinishRequest,
                BuffersRequest, PullBuffersRequest]


# -- replies (server -> client) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Ack:
    """ACK carrying ``step`` (async: the version the push was applied to)."""

    step: int


@dataclass(frozen=True)
class Params:
    """PARAMS at ``version``; the handler registered a reader for it, which sending releases."""

    version: int


@dataclass(frozen=True)
class Buffers:
    """BUFFERS: the buffers an attempt starts from (fp32 words, ``BufferStore.start``), answering PULL_BUFFERS."""

    step: int
    words: Any  # torch.Tensor


Reply = Union[Ack, Params, Buffers]

