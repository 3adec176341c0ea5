"""Opening one connection to a parameter-server shard: TCP (TLS with ``ps.tls``), the mutual HMAC
handshake, the WELCOME and its checks against the worker's own model. ``PSClient`` opens one per shard.

Why a retry: a listener under a flood of unauthenticated sockets evicts the oldest pending one
(``pipeline.ps.transport.listener``), which may be an honest worker's; a connection that is closed or reset during
the handshake, without a refusal, is opened again until the connect deadline. A refusal (ERROR frame) or a
listener that fails to prove the secret is final at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pipeline.errors import AuthenticationError, PSError, PSTimeoutError, ProtocolError
from pipeline.ps.transport.protocol import Channel, MsgType, ServerInfo, check_welcome, parse_welcome
from pipeline.ps.transport.shm_offer import request_rings
from pipeline.wire.deadline import Timeout, deadline_after
from pipeline.wire.frames import PeerClosedError
from pipeline.wire.handshake import PeerRefused, client_handshake, refusal_text
from pipeline.wire.sockets import connect

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import PinnedCert

log = logging.getLogger(__name__)

_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 1.0


@dataclass(frozen=True)
class Opening:
    """Who opens (``rank``, ``generation``, the job's ``secret``), what it expects of the server (its own
    model's sizes; None: unchecked) and, with ``ps.tls``, the pinned certificate (``pipeline.wire.tls``)."""

    rank: int
    generation: int
    secret: bytes
    expected_params: Optional[int] = None
    expected_buffer_words: Optional[int] = None
    tls: Optional[PinnedCert] = None


class _Dropped(Exception):
    """Closed or reset during the handshake without a refusal: worth another try."""


def open_shard(opening: Opening, host: str, port: int, timeout: Timeout) -> tuple[Channel, ServerInfo]:
    """A connected, mutually authenticated channel to the shard at ``host:port`` and its checked WELCOME.
    Raises AuthenticationError (refused, or the server failed to prove itself or lied about sizes),
    PSTimeoutError naming ``timeout``'s key, or PSError (unreachable)."""
    deadline = deadline_after(timeout)
    pause, attempts = _RETRY_FIRST_S, 0
    while True:
        attempts += 1
        try:
            return _attempt(opening, host, port, timeout, deadline, first=attempts == 1)
        except PSTimeoutError:
            if attempts == 1:
                raise
            give_up = True  # the first drop is the story, not the wait of the retry
        except _Dropped:
            give_up = deadline is None or time.monotonic() + pause >= deadline
        if give_up:
            raise AuthenticationError(
                f"the parameter server at {host}:{port} closed the connection during the handshake of "
                f"rank {opening.rank} ({attempts} attempt(s); wrong secret, generation or rank, or a flood "
                "of connections on the server?)") from None
        log.info("rank %s: the parameter server at %s:%s dropped the handshake; retrying in %.2fs",
                 opening.rank, host, port, pause)
        time.sleep(pause)
        pause = min(2 * pause, _RETRY_MAX_S)


def _drops(opening: Opening) -> tuple[type[BaseException], ...]:
    """How a listener's eviction of this pending connection shows on this side."""
    drops: tuple[type[BaseException], ...] = (PeerClosedError, ConnectionResetError, BrokenPipeError)
    if opening.tls is not None:  # ssl is imported already: the socket was wrapped
        import ssl

        drops += (ssl.SSLEOFError, ssl.SSLZeroReturnError)
    return drops


def _timeout_error(opening: Opening, what: str, wait: Timeout) -> PSTimeoutError:
    return PSTimeoutError(f"rank {opening.rank} {wait.message(what)}")


def _attempt(opening: Opening, host: str, port: int, timeout: Timeout, deadline: Optional[float], *,
             first: bool) -> tuple[Channel, ServerInfo]:
    rank = opening.rank
    # A retry connects within what is left of the one deadline (its message names the same key).
    left = timeout if first or deadline is None else \
        Timeout(max(deadline - time.monotonic(), 1e-3), timeout.key, timeout.inherited_from)
    sock = connect(host, port, left, who=f"rank {rank}", peer="the parameter server",
                   advice="check that executors can reach the driver")
    channel = None
    try:
        if opening.tls is not None:
            from pipeline.wire.tls import wrap_client

            sock = wrap_client(sock, opening.tls, deadline=deadline, peer=f"the parameter server at {host}:{port}")
        channel = Channel(sock, max_elements=0)
        try:
            client_handshake(channel, opening.secret, rank=rank, generation=opening.generation,
                             deadline=deadline, mutual=True, peer=f"the parameter server at {host}:{port}")
        except PeerRefused as refused:
            raise AuthenticationError(f"parameter server refused rank {rank}: {refused.reason}") from None
        header = channel.recv_header(deadline)
        if header.type is MsgType.ERROR:
            raise AuthenticationError(f"parameter server refused rank {rank}: "
                                      f"{refusal_text(channel, header, deadline)}")
        if header.type is not MsgType.WELCOME:
            raise ProtocolError(f"expected WELCOME, got {header.type.name}")
        body = channel.recv_json(header, deadline)
        info = check_welcome(parse_welcome(body), expected_params=opening.expected_params,
                             expected_buffer_words=opening.expected_buffer_words)
        if body.get("shared_memory") is True and opening.tls is None:  # ps.shared_memory_mb: same host
            request_rings(channel, rank=rank, generation=opening.generation, deadline=deadline)
        return channel, info
    except BaseException as exc:
        (channel.close() if channel is not None else sock.close())
        if isinstance(exc, AuthenticationError):
            raise
        if isinstance(exc, TimeoutError):
            raise _timeout_error(opening, f"the handshake with the parameter server at {host}:{port}",
                                 timeout) from None
        if isinstance(exc, _drops(opening)):
            raise _Dropped() from None
        if isinstance(exc, (PSError, OSError)):
            raise AuthenticationError(f"handshake of rank {rank} failed: {exc}") from exc
        raise
