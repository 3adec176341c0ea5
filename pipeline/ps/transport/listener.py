"""One shard's listening socket: the accept loop, a thread per connection, and the server side of the
mutual HMAC handshake (CHALLENGE -> AUTH + the worker's CHALLENGE -> admission -> AUTH -> WELCOME).

Why one thread per connection: only that thread writes to its socket, so frames never interleave.
Connections are capped so a flood of unauthenticated sockets cannot exhaust threads or memory: pending
(unauthenticated) ones in ``pipeline.wire.pending.PendingSlots`` (the oldest evicted at its cap, so a
real rank still gets in during a flood), admitted ones by ``max_connections``. An unauthenticated socket
gets at most ``HANDSHAKE_S`` (``pipeline.wire.handshake``) to prove the secret: an honest worker answers
the CHALLENGE at once, and silent sockets must not hold slots for a whole step deadline. With ``ps.tls``
the TLS handshake runs in the connection's thread, inside the same pending slot and deadline.

``authenticate`` is the wire part of the handshake on its own (nonce, AUTH, MAC check): the shared
``pipeline.wire.handshake.server_handshake``, mutual; admission, the server's answer and the WELCOME stay here.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol

from pipeline.errors import PSError
from pipeline.ps.transport.connection import RankConnection
from pipeline.ps.server.messages import AUTH
from pipeline.ps.transport.protocol import Channel, MsgType
from pipeline.ps.server.stats import ShardStats
from pipeline.ps.server.tensor_threads import limit_this_thread
from pipeline.wire.deadline import Timeout, deadline_after
from pipeline.wire.handshake import HANDSHAKE_S, Claim, Refusal, answer, send_refusal, server_handshake
from pipeline.wire.pending import PENDING_CAP, PendingSlots
from pipeline.wire.sockets import listen, set_socket_options

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import ServerCert

logger = logging.getLogger(__name__)

_JOIN_DEADLINE_S = 2.0
_ACCEPT_POLL_S = 0.25


class HandshakeRejected(Exception):
    """The connection is refused: ``reason`` goes to the peer as an ERROR frame of ``kind``."""

    def __init__(self, reason: str, kind: str = AUTH, *, generation: int = 0, rank: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.generation = generation
        self.rank = rank


def authenticate(channel: Channel, *, secret: bytes, generation: int, timeout: Timeout) -> Claim:
    """CHALLENGE with a fresh nonce, then the peer's AUTH must carry the MAC of the secret over it,
    bound to the rank and generation it claims, followed by the peer's own CHALLENGE (mutual: the
    server answers it once the rank is admitted, before WELCOME). Returns that claim; raises
    HandshakeRejected."""
    try:
        return server_handshake(channel, secret, rank=0, generation=generation,
                                timeout=timeout.shorter(HANDSHAKE_S), mutual=True)
    except Refusal as refused:
        raise HandshakeRejected(refused.reason) from None


class ConnectionHost(Protocol):
    """What the listener needs of its shard (``shard.ShardServer``)."""

    def current_generation(self) -> int: ...
    def admit(self, claim: Claim, channel: Channel) -> tuple[RankConnection, dict[str, Any]]:
        """Register an authenticated rank, returning it and its WELCOME; raises HandshakeRejected."""
    def serve(self, conn: RankConnection, peer: tuple) -> None: ...
    def release_locked(self, conn: RankConnection) -> None: ...


class ShardListener:
    """The listening socket and connection threads of one shard. ``cond`` is the shard's condition,
    which also guards ``stats``; ``close()`` is called once, after the shard stopped serving."""

    def __init__(self, host: str, port: int, *, shard_index: int, cond: threading.Condition,
                 stats: ShardStats, max_connections: int, secret: bytes, step_timeout: Timeout,
                 owner: ConnectionHost, pending_connections: int = PENDING_CAP,
                 tls: Optional[ServerCert] = None, tensor_threads: int = 0) -> None:
        self._host = host
        self._port = port
        self._index = shard_index
        self._cond = cond
        self._stats = stats
        self._max_connections = max_connections  # admitted (authenticated) connections
        self._pending = PendingSlots(pending_connections)
        self._admitted = 0
        self._tls = tls  # pipeline.wire.tls.ServerCert, or None
        self._secret = secret
        self._timeout = step_timeout
        self._owner = owner
        self._tensor_threads = tensor_threads  # ps.server_threads, set in each connection thread
        self._closed = False
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._threads: set[threading.Thread] = set()
        self._open_channels: set[Channel] = set()
        self.address: tuple[str, int] | None = None

    def bind(self) -> tuple[str, int]:
        """Bind ``host:port`` (port 0 = OS-chosen); returns the bound address. Nothing is accepted
        before ``start_accepting()``, so the shard can finish what every WELCOME announces first."""
        try:  # with the large buffers, inherited by accepted sockets from the SYN on
            listener = listen(self._host, self._port, backlog=128)
        except OSError as exc:
            raise PSError(f"parameter server could not bind {self._host}:{self._port}: {exc} "
                          "(check ps.host / spark.driver.host)") from exc
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self.address = (host, port)
        return self.address

    def start_accepting(self) -> None:
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"ps-accept-{self._index}")
        self._accept_thread.start()

    def live_bytes_locked(self) -> tuple[int, int]:
        """(received, sent) of the connections still open; closed ones are folded into the stats."""
        live = list(self._open_channels)
        return sum(c.bytes_received for c in live), sum(c.bytes_sent for c in live)

    def close(self) -> None:
        """Shut every socket down (which wakes their blocked reads) and join the threads."""
        with self._cond:
            self._closed = True
            channels = list(self._open_channels)
        if self._listener is not None:
            try:  # shutdown wakes the blocked accept at once on Linux; the poll timeout elsewhere
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for channel in channels:
            channel.close()
        deadline = time.monotonic() + _JOIN_DEADLINE_S
        threads = [t for t in [self._accept_thread, *list(self._threads)] if t is not None]
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive() and t is not threading.current_thread()]
        if stuck:
            logger.warning("parameter server threads still running after close: %s", stuck)

    # -- accepting (accept thread) -------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed or self._listener.fileno() < 0:
                    return
                # EMFILE, ECONNABORTED...: transient; keep serving the workers already connected.
                logger.warning("parameter server accept failed: %s; retrying", exc)
                time.sleep(0.05)
                continue
            with self._cond:
                if self._closed:
                    sock.close()
                    return
                channel = Channel(sock, max_elements=0)
                self._open_channels.add(channel)
                thread = threading.Thread(target=self._serve_connection, args=(channel, peer),
                                          name=f"ps-conn-{peer[0]}:{peer[1]}", daemon=True)
                self._threads.add(thread)
            if self._pending.add(channel) is not None:
                with self._cond:
                    self._stats.rejected_connections += 1
                evictions = self._pending.evictions
                if evictions == 1 or evictions % 1000 == 0:  # a flood must not flood the log too
                    logger.warning("parameter server: %s unauthenticated connections pending, the oldest "
                                   "evicted (%s so far): a flood of connections, or a port scan?",
                                   self._pending.cap, evictions)
            thread.start()

    # -- one connection (its own thread) --------------------------------------------------------------
    def _serve_connection(self, channel: Channel, peer: tuple) -> None:
        conn: RankConnection | None = None
        try:
            # A rank's pushes are summed and stepped on its own connection thread.
            limit_this_thread(self._tensor_threads)
            try:
                set_socket_options(channel.sock)
            except OSError:
                pass  # the peer is already gone; the handshake below notices and logs it
            conn = self._handshake(channel, peer)
            if conn is not None:
                self._owner.serve(conn, peer)
        except Exception:  # a bug must not take the server down; log it with the peer
            logger.exception("parameter server connection handler for %s crashed", peer)
        finally:
            channel.close()
            with self._cond:
                self._open_channels.discard(channel)
                self._stats.bytes_received += channel.bytes_received
                self._stats.bytes_sent += channel.bytes_sent
                if conn is not None:
                    self._owner.release_locked(conn)
                    self._admitted -= 1
                self._threads.discard(threading.current_thread())
                self._cond.notify_all()

    def _handshake(self, channel: Channel, peer: tuple) -> RankConnection | None:
        """(TLS,) authenticate, admit, WELCOME. Returns the registered connection, or None if rejected."""
        evicted = False
        try:
            try:
                if self._tls is not None:
                    from pipeline.wire.tls import wrap_server

                    try:
                        channel.sock = wrap_server(channel.sock, self._tls,
                                                   timeout=self._timeout.shorter(HANDSHAKE_S).seconds)
                    except OSError as exc:  # not TLS, or not our certificate: no frame can reach the peer
                        raise HandshakeRejected(f"TLS handshake failed: {exc}", kind="tls") from None
                claim = authenticate(channel, secret=self._secret, generation=self._owner.current_generation(),
                                     timeout=self._timeout)
            finally:
                evicted = self._pending.settle(channel)
            if evicted:
                return None  # counted and logged by the accept loop; the socket is already shut down
            with self._cond:
                if self._admitted >= self._max_connections:
                    raise HandshakeRejected(f"more than {self._max_connections} open connections")
                self._admitted += 1
            try:
                conn, welcome = self._owner.admit(claim, channel)
            except BaseException:
                with self._cond:
                    self._admitted -= 1
                raise
        except HandshakeRejected as rejected:
            if not evicted:  # an eviction was counted and logged (once per many) by the accept loop
                self._reject(channel, peer, rejected)
            return None
        try:
            assert claim.nonce is not None
            # The server's proof, bound to the worker's nonce: only then does the worker trust WELCOME.
            answer(channel, self._secret, claim.nonce, generation=conn.generation, rank=self._index,
                   deadline=deadline_after(self._timeout.shorter(HANDSHAKE_S)))
            channel.send_json(MsgType.WELCOME, welcome, generation=conn.generation, rank=conn.rank,
                              timeout=self._timeout.seconds)
        except (OSError, PSError) as exc:
            logger.warning("rank %s from %s vanished during the handshake: %s", conn.rank, peer, exc)
        version = getattr(channel.sock, "version", None)  # an ssl.SSLSocket's: ps.tls
        logger.info("rank %s connected from %s (generation %s, %s)", conn.rank, peer, conn.generation,
                    version() if version is not None else "plain TCP")
        return conn

    def _reject(self, channel: Channel, peer: tuple, rejected: HandshakeRejected) -> None:
        """Drop an unauthenticated or refused connection: log, count, best-effort ERROR frame."""
        logger.warning("rejected PS connection from %s: %s", peer, rejected.reason)
        with self._cond:
            self._stats.rejected_connections += 1
        if rejected.kind == "tls":
            return
        send_refusal(channel, rejected.reason, kind=rejected.kind, generation=rejected.generation,
                     rank=rejected.rank, timeout=self._timeout.seconds)
        channel.linger_close()

