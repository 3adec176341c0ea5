"""An authenticated point-to-point TCP link between adjacent pipeline stages.

Activations of stage p go forward to stage p+1 and their gradients come back over the same connection.
The link has the parameter-server wire's properties because it crosses the same untrusted network:

* Both ends prove they hold the job secret for this generation before any tensor moves: the wire's
  handshake (``pipeline.wire.handshake``, the same frames and HMAC as the parameter server's), run both
  ways: stage p answers stage p+1's nonce, then stage p+1 answers stage p's, because a forged listener
  could otherwise feed stage p made-up gradients.
* Tensor frames have their own fixed 48-byte header (magic ``SHPL``, so a PS frame arriving on a link, or
  the reverse, fails on the magic instead of being misread). It carries step, micro-batch index and the
  2-D shape, and is validated, element cap included, before a payload byte is read or a buffer
  allocated. Payloads are raw little-endian float32, received straight into the destination tensor;
  nothing is ever unpickled.
* Every receive and send has a deadline (``timeouts.link_s``), accepting and connecting too
  (``timeouts.connect_s``); each error names what was awaited and the key that sets the wait.

Who connects: stage p+1 opens a :class:`StageListener` (port 0: an ephemeral port, published through
the launcher) and stage p calls :func:`connect_link` with that address. A stage that both accepts from
p-1 and connects to p+1 may do the two in either order: the TCP connect completes in the listener's
backlog, so a chain of stages cannot deadlock on it.

The frames themselves (header layout, validation) are ``pipeline.parallel.link_frames``'.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Optional, Union

import torch

from pipeline.errors import AuthenticationError, ProtocolError, PSError
from pipeline.parallel.link_frames import (  # noqa: F401 - the link's frames, re-exported
    LINK_HEADER,
    LINK_MAGIC,
    LINK_VERSION,
    _WHAT,
    LinkFrame,
    LinkHeader,
    _LinkChannel,
    decode_link_header,
)
from pipeline.wire.deadline import CONNECT_KEY, LINK_KEY, Timeout, deadline_after
from pipeline.wire.frames import Channel, PeerClosedError, tensor_view
from pipeline.wire.handshake import (
    HANDSHAKE_S,
    PeerRefused,
    Refusal,
    answer,
    client_handshake,
    secret_bytes,
    send_refusal,
    server_handshake,
)
from pipeline.wire.pending import PENDING_CAP, PendingSlots
from pipeline.wire.sockets import connect, listen, set_socket_options

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import PinnedCert, ServerCert

logger = logging.getLogger(__name__)

# 64 Mi floats (256 MiB) per frame unless the caller knows better (e.g. micro_rows * widest activation).
DEFAULT_MAX_ELEMENTS = 1 << 26
DEFAULT_TIMEOUT_S = 120.0
_MAX_ERROR_CHARS = 2000

Secret = Union[bytes, str]


def _waits(timeout_s: Union[float, Timeout],
           connect_timeout: Union[float, Timeout, None]) -> tuple[Timeout, Timeout]:
    """(link wait, connect wait): floats become timeouts.link_s / timeouts.connect_s following
    ps.timeout_s; no connect wait means as long as the link wait."""
    link = Timeout.of(timeout_s, LINK_KEY)
    return link, Timeout.of(link.seconds if connect_timeout is None else connect_timeout, CONNECT_KEY)


class StageLink:
    """One authenticated connection between stage ``stage`` and its neighbour ``peer_stage``.

    Not thread-safe: one thread drives a link (the stage's schedule). ``timeout_s`` bounds every
    receive and send (a float is ``timeouts.link_s`` following ``ps.timeout_s``). A link that saw a
    protocol error or timeout is closed, because the stream may be out of sync; the step fails and the
    job restarts the generation.
    """

    def __init__(self, channel: _LinkChannel, *, stage: int, peer_stage: int, rank: int, peer_rank: int,
                 generation: int, timeout_s: Union[float, Timeout]) -> None:
        self._channel = channel
        self.stage = stage
        self.peer_stage = peer_stage
        self.rank = rank
        self.peer_rank = peer_rank
        self.generation = generation
        self.timeout = Timeout.of(timeout_s, LINK_KEY)
        self.timeout_s = self.timeout.seconds
        self.closed = False

    @property
    def bytes_sent(self) -> int:
        return self._channel.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._channel.bytes_received

    @property
    def max_elements(self) -> int:
        return self._channel.max_elements

    def _peer(self) -> str:
        return f"stage {self.peer_stage} (rank {self.peer_rank})"

    def describe(self, kind: LinkFrame, step: int, micro: int) -> str:
        """What a receive of ``kind`` awaits, as error messages name it."""
        return f"{_WHAT[kind]} for step {step} micro-batch {micro} from {self._peer()}"

    # -- sending ---------------------------------------------------------------------------------
    def send(self, kind: LinkFrame, step: int, micro: int, tensor: torch.Tensor) -> None:
        """Send a 2-D float32 tensor (detached; copied only if not contiguous)."""
        if self.closed:
            raise PSError(f"the link from stage {self.stage} to {self._peer()} is closed")
        if tensor.dim() != 2 or tensor.dtype != torch.float32:
            raise PSError(f"stage links carry 2-D float32 tensors; stage {self.stage} tried to send "
                          f"{_WHAT[kind]} of shape {tuple(tensor.shape)} and dtype {tensor.dtype}")
        data = tensor.detach().cpu().contiguous()
        rows, cols = data.shape
        if rows * cols > self.max_elements:
            raise PSError(f"{_WHAT[kind]} of shape ({rows}, {cols}) exceed the {self.max_elements} elements "
                          f"the link to {self._peer()} accepts per frame; use more micro-batches")
        header = LinkHeader(kind, self.generation, self.rank, step, micro, rows, cols)
        try:
            self._channel.send(header, tensor_view(data.reshape(-1)), timeout=self.timeout_s)
        except TimeoutError:
            self.close()
            raise self.timeout.error(f"{_WHAT[kind]} for step {step} micro-batch {micro} to go out to "
                                     f"{self._peer()}", why="that stage may only be slow") from None
        except ConnectionError:
            self.close()
            raise PSError(f"{self._peer()} closed the link while stage {self.stage} sent {_WHAT[kind]} for step "
                          f"{step} micro-batch {micro}; its log says why") from None
        except OSError as exc:
            self.close()
            raise PSError(f"sending {_WHAT[kind]} for step {step} micro-batch {micro} to {self._peer()} "
                          f"failed: {exc}") from exc

    def send_activation(self, step: int, micro: int, tensor: torch.Tensor) -> None:
        self.send(LinkFrame.ACTIVATION, step, micro, tensor)

    def send_grad(self, step: int, micro: int, tensor: torch.Tensor) -> None:
        self.send(LinkFrame.ACTIVATION_GRAD, step, micro, tensor)

    # -- receiving -------------------------------------------------------------------------------
    def recv(self, kind: LinkFrame, step: int, micro: int, *, rows: Optional[int] = None,
             cols: Optional[int] = None) -> torch.Tensor:
        """Receive the frame of ``kind`` for (``step``, ``micro``); anything else is refused.

        ``rows``/``cols``, where the caller knows them, must match the frame's shape. Returns a fresh
        (rows, cols) float32 tensor.
        """
        if self.closed:
            raise PSError(f"the link from stage {self.stage} to {self._peer()} is closed")
        what = self.describe(kind, step, micro)
        deadline = deadline_after(self.timeout_s)
        try:
            header = self._channel.recv_link_header(deadline)
            if header.generation != self.generation or header.rank != self.peer_rank:
                raise ProtocolError(f"frame from generation {header.generation} rank {header.rank} while "
                                    f"awaiting {what} (generation {self.generation})")
            if (header.type, header.step, header.micro) != (kind, step, micro):
                raise ProtocolError(
                    f"expected {what} but received {_WHAT[header.type]} for step {header.step} micro-batch "
                    f"{header.micro}; the stages are out of step"
                )
            if (rows is not None and header.rows != rows) or (cols is not None and header.cols != cols):
                raise ProtocolError(
                    f"{what} have shape ({header.rows}, {header.cols}), expected "
                    f"({rows if rows is not None else '*'}, {cols if cols is not None else '*'})"
                )
            return self._channel.recv_link_payload(header, deadline)
        except TimeoutError:
            self.close()
            raise self.timeout.error(what, why="if that stage stopped, its log says why") from None
        except (PeerClosedError, ConnectionError):
            # A reset is a close with our frames still unread on the peer's side: the same story.
            self.close()
            raise PSError(f"{self._peer()} closed the link while stage {self.stage} awaited {what}; "
                          "its log says why") from None
        except ProtocolError as exc:
            self.close()
            raise ProtocolError(f"stage link from {self._peer()}: {exc}") from None
        except OSError as exc:
            self.close()
            raise PSError(f"receiving {what} failed: {exc}") from exc

    def recv_activation(self, step: int, micro: int, *, rows: Optional[int] = None,
                        cols: Optional[int] = None) -> torch.Tensor:
        return self.recv(LinkFrame.ACTIVATION, step, micro, rows=rows, cols=cols)

    def recv_grad(self, step: int, micro: int, *, rows: Optional[int] = None,
                  cols: Optional[int] = None) -> torch.Tensor:
        return self.recv(LinkFrame.ACTIVATION_GRAD, step, micro, rows=rows, cols=cols)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Idempotent; never raises. Wakes a thread blocked in recv on this link."""
        self.closed = True
        self._channel.close()

    def __enter__(self) -> "StageLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Race:
    """The handshakes of one ``accept``: the first to succeed wins; the rest are shut down or closed."""

    def __init__(self) -> None:
        self.slots = PendingSlots(PENDING_CAP)
        self.wake, self._waker = socket.socketpair()
        self._lock = threading.Lock()
        self._won: Optional[StageLink] = None
        self._closed = False

    def run(self, handshake, channel: "_LinkChannel", peer: tuple, handshake_s: float) -> None:
        try:
            link = handshake(channel, peer, handshake_s, self.slots)
        except Exception:  # a bug must not hang accept: log it with the peer; the wait goes on
            logger.exception("stage link handshake with %s crashed", peer)
            channel.close()
            return
        if link is None:
            channel.close()
            return
        with self._lock:
            keep = self._won is None and not self._closed
            if keep:
                self._won = link
        if not keep:
            link.close()
            return
        try:
            self._waker.send(b"x")
        except OSError:
            pass

    def winner(self) -> Optional[StageLink]:
        with self._lock:
            return self._won

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.slots.shut_all()
        self.wake.close()
        self._waker.close()


class StageListener:
    """Stage ``stage``'s listening socket for the link from stage ``stage - 1``.

    ``port`` 0 binds an ephemeral port; :attr:`address` is what stage ``stage - 1`` connects to.
    ``expect_rank``, if given, is the only rank accepted as the upstream peer. ``timeout_s`` bounds the
    accepted link's receives and sends (``timeouts.link_s``), ``connect_timeout`` the wait in
    :meth:`accept` (``timeouts.connect_s``; None: as long as ``timeout_s``).
    """

    def __init__(self, host: str, secret: Secret, generation: int, *, stage: int, rank: int,
                 expect_rank: Optional[int] = None, port: int = 0,
                 max_elements: int = DEFAULT_MAX_ELEMENTS, timeout_s: Union[float, Timeout] = DEFAULT_TIMEOUT_S,
                 connect_timeout: Union[float, Timeout, None] = None, tls: Optional[ServerCert] = None) -> None:
        self._secret = secret_bytes(secret)
        self._tls = tls  # ps.tls: pipeline.wire.tls.ServerCert
        self.generation = generation
        self.stage = stage
        self.rank = rank
        self.expect_rank = expect_rank
        self.max_elements = max_elements
        self.timeout, self.connect_timeout = _waits(timeout_s, connect_timeout)
        self.timeout_s = self.timeout.seconds
        self._sock = listen(host, port, backlog=8)
        self._host = host

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._sock.getsockname()[1]

    def accept(self, timeout_s: Union[float, Timeout, None] = None) -> StageLink:
        """Wait for stage ``stage - 1`` to connect and authenticate; connections that fail the
        handshake are refused (ERROR frame, logged) and the wait goes on until the deadline.
        ``timeout_s``: the listener's ``connect_timeout`` unless given (a float is ``timeouts.connect_s``).

        Each connection's handshake runs in its own thread, in a pending slot (``pipeline.wire.pending``:
        the oldest evicted at the cap), so idle or garbage sockets cannot hold the real peer out."""
        wait = self.connect_timeout if timeout_s is None else Timeout.of(timeout_s, CONNECT_KEY)
        deadline = deadline_after(wait)
        race = _Race()
        try:
            while True:
                link = race.winner()
                if link is not None:
                    return link
                left = deadline - time.monotonic()
                if left <= 0:
                    host, port = self.address
                    raise wait.error(f"stage {self.stage - 1} to connect to stage {self.stage}'s link at "
                                     f"{host}:{port}", why="check that executors can reach each other")
                ready, _, _ = select.select([self._sock, race.wake], [], [], left)
                if self._sock not in ready:
                    continue
                try:
                    sock, peer = self._sock.accept()
                except (BlockingIOError, TimeoutError):
                    continue
                channel = _LinkChannel(sock, max_elements=0)
                if race.slots.add(channel) is not None:
                    logger.warning("stage %s: %s unauthenticated link connections pending, the oldest evicted",
                                   self.stage, race.slots.cap)
                threading.Thread(target=race.run, args=(self._handshake, channel, peer, min(left, HANDSHAKE_S)),
                                 name=f"link-handshake-{peer[0]}:{peer[1]}", daemon=True).start()
        finally:
            race.close()

    def _handshake(self, channel: "_LinkChannel", peer: tuple, handshake_s: float,
                   slots: PendingSlots) -> Optional[StageLink]:
        """(TLS,) the wire's server handshake, mutual; then this stage's own admission (generation, rank)."""
        try:
            try:
                set_socket_options(channel.sock)
                if self._tls is not None:
                    from pipeline.wire.tls import wrap_server

                    channel.sock = wrap_server(channel.sock, self._tls, timeout=handshake_s)
                claim = server_handshake(channel, self._secret, rank=self.rank, generation=self.generation,
                                         timeout=handshake_s, mutual=True)
            finally:
                evicted = slots.settle(channel)
        except Refusal as exc:
            return None if evicted else self._reject(channel, peer, exc.reason)
        except OSError as exc:
            return None if evicted else self._reject(channel, peer, f"handshake failed: {exc}")
        rank, generation = claim.rank, claim.generation
        if generation != self.generation:
            return self._reject(channel, peer, f"rank {rank} belongs to generation {generation} but stage "
                                               f"{self.stage} is at generation {self.generation}; stale task "
                                               "from an earlier attempt")
        if self.expect_rank is not None and rank != self.expect_rank:
            return self._reject(channel, peer, f"rank {rank} is not stage {self.stage - 1} (expected rank "
                                               f"{self.expect_rank})")
        assert claim.nonce is not None
        try:
            answer(channel, self._secret, claim.nonce, generation=self.generation, rank=self.rank,
                   deadline=deadline_after(handshake_s))
        except (PSError, OSError) as exc:
            return self._reject(channel, peer, f"rank {rank} vanished during the handshake: {exc}")
        channel.max_elements = self.max_elements
        logger.info("stage %s (rank %s) accepted the link from stage %s (rank %s) at %s",
                    self.stage, self.rank, self.stage - 1, rank, peer)
        return StageLink(channel, stage=self.stage, peer_stage=self.stage - 1, rank=self.rank,
                         peer_rank=rank, generation=self.generation, timeout_s=self.timeout)

    def _reject(self, channel: Channel, peer: tuple, reason: str) -> None:
        logger.warning("stage %s refused a link connection from %s: %s", self.stage, peer, reason)
        send_refusal(channel, reason, generation=self.generation, rank=self.rank, timeout=1.0,
                     max_chars=_MAX_ERROR_CHARS)
        channel.linger_close()
        return None

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:  # pragma: no cover
            pass

    def __enter__(self) -> "StageListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect_link(host: str, port: int, secret: Secret, generation: int, *, stage: int, rank: int,
                 expect_rank: Optional[int] = None, max_elements: int = DEFAULT_MAX_ELEMENTS,
                 timeout_s: Union[float, Timeout] = DEFAULT_TIMEOUT_S,
                 connect_timeout: Union[float, Timeout, None] = None,
                 tls: Optional[PinnedCert] = None) -> StageLink:
    """Connect stage ``stage`` to stage ``stage + 1``'s listener at ``host:port`` and authenticate
    both ways. ``expect_rank``, if given, is the only rank accepted as the downstream peer.
    ``timeout_s`` bounds the link's receives and sends (``timeouts.link_s``), ``connect_timeout``
    connecting and the handshake (``timeouts.connect_s``; None: as long as ``timeout_s``). ``tls``
    (``ps.tls``): the job certificate's pinned fingerprint (``pipeline.wire.tls.PinnedCert``)."""
    link_wait, connect_wait = _waits(timeout_s, connect_timeout)
    who = f"stage {stage} (rank {rank})"
    what = f"the link handshake of {who} with stage {stage + 1} at {host}:{port}"
    secret_b = secret_bytes(secret)
    deadline = deadline_after(connect_wait)
    sock = connect(host, port, connect_wait, who=who, peer=f"stage {stage + 1}",
                   advice="check that executors can reach each other")
    channel = _LinkChannel(sock, max_elements=0)
    try:
        if tls is not None:
            from pipeline.wire.tls import wrap_client

            channel.sock = wrap_client(sock, tls, deadline=deadline, peer=f"stage {stage + 1} at {host}:{port}")
        try:
            claim = client_handshake(channel, secret_b, rank=rank, generation=generation, deadline=deadline,
                                     mutual=True, peer=f"the listener at {host}:{port}")
        except PeerRefused as exc:
            if not exc.answered:
                raise
            raise AuthenticationError(f"stage {stage + 1} at {host}:{port} refused {who}: "
                                      f"{exc.reason}") from None
        assert claim is not None
        if expect_rank is not None and claim.rank != expect_rank:
            raise AuthenticationError(f"the listener at {host}:{port} is rank {claim.rank}, expected stage "
                                      f"{stage + 1} on rank {expect_rank}")
    except AuthenticationError:
        channel.close()
        raise
    except TimeoutError:
        channel.close()
        raise connect_wait.error(what) from None
    except PeerClosedError:
        channel.close()
        raise AuthenticationError(f"stage {stage + 1} at {host}:{port} closed the connection during {what} "
                                  "(wrong secret or generation?)") from None
    except (PSError, OSError) as exc:
        channel.close()
        raise AuthenticationError(f"{what} failed: {exc}") from exc
    channel.max_elements = max_elements
    logger.info("stage %s (rank %s) linked to stage %s (rank %s) at %s:%s", stage, rank, stage + 1,
                claim.rank, host, port)
    return StageLink(channel, stage=stage, peer_stage=stage + 1, rank=rank, peer_rank=claim.rank,
                     generation=generation, timeout_s=link_wait)
