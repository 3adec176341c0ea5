"""The HMAC challenge-response every shardline connection opens with.

The listener sends a fresh 32-byte nonce (CHALLENGE); the connector answers with
HMAC-SHA256(secret, nonce ‖ rank ‖ generation) (AUTH), proving it holds the per-job secret for that rank
and generation without sending the secret, in a form that cannot be replayed on another connection.
With ``mutual=True`` the connector then challenges the listener the same way, and the listener answers
once it has accepted the connector: a forged listener can neither learn anything nor feed the connector
made-up data. Every connection runs it mutually: the pipeline stage links and the parameter server
(whose answer comes after admission, right before WELCOME, so a worker trusts no WELCOME, shard address
or size from a listener that does not hold the job's secret).

Client side: :func:`client_handshake`. Server side: :func:`server_handshake` (then the caller's own
admission checks: generation, rank range, duplicates) and, when mutual, :func:`answer`. A refusal goes
back as an ERROR frame (:func:`send_refusal`) before the listener hangs up; the parameter server sends
its refusals of requests the same way. A listener gives a new connection at most :data:`HANDSHAKE_S`.

Headers are read with the channel's own decoder, so a protocol that validates more frame types (the
parameter server) reports a wrong frame by its name and refuses bad sizes before reading a payload.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from typing import Any, Optional, Union

from pipeline.errors import AuthenticationError, PSError, ProtocolError
from pipeline.wire.deadline import Timeout, deadline_after, remaining
from pipeline.wire.frames import NONCE_SIZE, Buffer, Channel, Control

MAX_REFUSAL_CHARS = 64 * 1024
# The longest a listener waits for a new connection's handshake: an honest peer answers at once, and a
# silent socket must not hold the listener (or a pending slot, pipeline.wire.pending) for a whole step or
# link deadline. Short, because each pending slot a flood holds is held this long.
HANDSHAKE_S = 3.0


def auth_mac(secret: bytes, nonce: bytes, rank: int, generation: int) -> bytes:
    """HMAC-SHA256(secret, nonce ‖ rank u32 LE ‖ generation u32 LE): binds the proof to one
    connection (fresh nonce), one rank and one generation so it cannot be replayed elsewhere."""
    return hmac.new(secret, nonce + struct.pack("<II", rank, generation), hashlib.sha256).digest()


def verify_mac(secret: bytes, nonce: bytes, rank: int, generation: int, mac: Buffer) -> bool:
    """Constant-time check of an AUTH payload."""
    return hmac.compare_digest(auth_mac(secret, nonce, rank, generation), bytes(mac))


def secret_bytes(secret: Union[bytes, str]) -> bytes:
    """The per-job secret as bytes (a str is its UTF-8 encoding)."""
    return secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)


class PeerRefused(AuthenticationError):
    """The peer answered with an ERROR frame; ``reason`` is its text, ``answered`` whether our own
    proof had already gone out (then the peer judged it, or our rank and generation)."""

    def __init__(self, reason: str, *, answered: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.answered = answered


class Refusal(AuthenticationError):
    """Server side: the connector failed the handshake; ``reason`` is what to log and send back."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Claim:
    """A verified AUTH: the peer holds the secret for ``rank`` and ``generation``. ``nonce`` is the
    peer's own CHALLENGE (mutual handshakes), for :func:`answer`."""

    rank: int
    generation: int
    nonce: Optional[bytes] = None


def _seconds(wait: Union[Timeout, float, None]) -> Optional[float]:
    return wait.seconds if isinstance(wait, Timeout) else wait


def refusal_text(channel: Channel, header: Any, deadline: Optional[float]) -> str:
    """The reason carried by an ERROR frame whose header was just read."""
    return str(channel.recv_json(header, deadline).get("error", "unspecified error"))


def send_challenge(channel: Channel, *, generation: int, rank: int, deadline: Optional[float]) -> bytes:
    """Send a fresh nonce; returns it."""
    nonce = secrets.token_bytes(NONCE_SIZE)
    channel.send_bytes(Control.CHALLENGE, nonce, generation=generation, rank=rank, timeout=remaining(deadline))
    return nonce


def read_challenge(channel: Channel, deadline: Optional[float], *, refusable: bool = True,
                   after: str = "") -> bytes:
    """The peer's nonce. With ``refusable`` an ERROR raises PeerRefused; any other frame is a
    ProtocolError ("expected CHALLENGE<after>, got ..."), refused before its payload is read."""
    header = channel.recv_header(deadline)
    if refusable and header.type == Control.ERROR:
        raise PeerRefused(refusal_text(channel, header, deadline), answered=False)
    if header.type != Control.CHALLENGE:
        raise ProtocolError(f"expected CHALLENGE{after}, got {header.type.name}")
    return channel.recv_bytes(header, deadline)


def answer(channel: Channel, secret: bytes, nonce: bytes, *, generation: int, rank: int,
           deadline: Optional[float]) -> None:
    """Send AUTH: the proof over ``nonce`` for this side's ``rank`` and ``generation``."""
    channel.send_bytes(Control.AUTH, auth_mac(secret, nonce, rank, generation), generation=generation,
                       rank=rank, timeout=remaining(deadline))


def read_proof(channel: Channel, deadline: Optional[float], *, refusable: bool) -> tuple[int, int, bytes]:
    """The peer's AUTH as (rank, generation, mac), unverified. With ``refusable`` an ERROR raises
    PeerRefused; otherwise every frame but AUTH is a ProtocolError, refused before its payload is read."""
    header = channel.recv_header(deadline)
    if refusable and header.type == Control.ERROR:
        raise PeerRefused(refusal_text(channel, header, deadline), answered=True)
    if header.type != Control.AUTH:
        raise ProtocolError(f"expected AUTH, got {header.type.name}")
    return header.rank, header.generation, channel.recv_bytes(header, deadline)


def client_handshake(channel: Channel, secret: bytes, *, rank: int, generation: int,
                     deadline: Optional[float], mutual: bool = False,
                     peer: str = "the peer") -> Optional[Claim]:
    """The connecting side: answer the listener's CHALLENGE; with ``mutual`` also challenge it and
    check its answer for ``generation``. Returns the listener's Claim (mutual) or None.

    Raises PeerRefused for an ERROR frame, AuthenticationError when ``peer`` fails to prove itself,
    ProtocolError / PeerClosedError / TimeoutError / OSError as the stream breaks (the caller names the
    wait and its Timeout)."""
    nonce = read_challenge(channel, deadline)
    answer(channel, secret, nonce, generation=generation, rank=rank, deadline=deadline)
    if not mutual:
        return None
    ours = send_challenge(channel, generation=generation, rank=rank, deadline=deadline)
    their_rank, their_generation, mac = read_proof(channel, deadline, refusable=True)
    if their_generation != generation or not verify_mac(secret, ours, their_rank, generation, mac):
        raise AuthenticationError(f"{peer} failed to prove it holds this job's secret for generation "
                                  f"{generation}; refusing the connection")
    return Claim(their_rank, their_generation)


def server_handshake(channel: Channel, secret: bytes, *, rank: int, generation: int,
                     timeout: Union[Timeout, float], mutual: bool = False) -> Claim:
    """The listening side: CHALLENGE, then the connector's AUTH (and, with ``mutual``, its CHALLENGE),
    verified against ``secret``. Returns the verified Claim; the caller then decides whether it admits
    that rank and generation (and, mutual, calls :func:`answer` with ``claim.nonce``).

    ``timeout`` bounds the whole exchange: an honest peer answers at once, and a silent socket must not
    hold the listener. Every failure raises Refusal with the reason to log and send back."""
    seconds = _seconds(timeout)
    deadline = deadline_after(seconds)
    try:
        nonce = send_challenge(channel, generation=generation, rank=rank, deadline=deadline)
        their_rank, their_generation, mac = read_proof(channel, deadline, refusable=False)
        # Checked before the peer's CHALLENGE is read: a forged AUTH is refused at once, whatever follows.
        if not verify_mac(secret, nonce, their_rank, their_generation, mac):
            raise Refusal(f"authentication failed for rank {their_rank}: wrong secret")
        their_nonce = None
        if mutual:
            their_nonce = read_challenge(channel, deadline, refusable=False, after=" after AUTH")
    except Refusal:
        raise
    except TimeoutError:
        raise Refusal(f"no AUTH within {seconds:g}s of connecting") from None
    except (PSError, OSError) as exc:
        raise Refusal(f"handshake failed: {exc}") from None
    return Claim(their_rank, their_generation, their_nonce)


def send_refusal(channel: Channel, reason: str, *, generation: int, rank: int, kind: str = "auth",
                 step: int = 0, timeout: Optional[float] = 1.0,
                 max_chars: int = MAX_REFUSAL_CHARS) -> None:
    """Best effort: an ERROR frame {error: reason, kind} (``kind`` tells the peer which exception to
    raise); a peer that is already gone is not an error, and a refusal never fails the sender."""
    try:
        channel.send_json(Control.ERROR, {"error": reason[:max_chars], "kind": kind},
                          generation=generation, rank=rank, step=step, timeout=timeout)
    except (OSError, PSError):
        pass
