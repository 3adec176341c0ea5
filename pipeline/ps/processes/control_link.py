"""The control link between the driver and a shard process on a worker host (``ps.placement: hosts``): the
``control_pipe`` messages over an authenticated TCP connection instead of an anonymous pipe.

Why a link of its own and not the PS frames: the driver's calls on a shard (start, state_dict, fail, a
new generation...) are ``ShardProcess``'s, already typed and data only (``codec``); only their carrier
changes. The connection opens like every other of the project: TCP to a specific address (TLS pinned to
the job's certificate with ``ps.tls``), then the mutual HMAC handshake (``pipeline.wire.handshake``), the
connector claiming ``link_rank(host, channel)`` in the attempt's generation. After it, a message is a
frame count and length-prefixed frames, every length checked against the receiver's own cap before a
byte of it is read.

A shard process opens two: ``CALLS`` (the driver's requests, answered in order) and ``EVENTS`` (what the
shard tells the driver unasked: failures, METRICS, buffers).
"""
from __future__ import annotations

import select
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any, Optional

from pipeline.errors import PSError, ProtocolError
from pipeline.ps.processes.codec import decode, encode
from pipeline.wire.deadline import Timeout, deadline_after, remaining

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import PinnedCert

CALLS, EVENTS = 0, 1
CHANNELS = 2
# A message's frames: the JSON document plus one per tensor or bytes value (a state dict has a few dozen).
MAX_FRAMES = 4096
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")


def link_rank(host_index: int, channel: int) -> int:
    """The rank a shard process claims in the handshake: its host's index and which of its two links."""
    return host_index * CHANNELS + channel


def parse_link_rank(rank: int) -> tuple[int, int]:
    return divmod(rank, CHANNELS)


class Link:
    """One end of a control link carrying whole messages; the ``control_pipe.Pipe`` surface (send, recv,
    poll, close). ``max_bytes`` caps what one received message may hold (its frames together)."""

    def __init__(self, sock: socket.socket, *, max_bytes: int, peer: str) -> None:
        self._sock = sock
        self.max_bytes = max_bytes
        self._peer = peer
        self._send_lock = threading.Lock()
        self._io_timeout: Optional[float] = None
        sock.settimeout(None)

    @property
    def peer(self) -> str:
        return self._peer

    def set_io_timeout(self, seconds: Optional[float]) -> None:
        """Bound every send and every read inside a message (None: block). A read that stalls past it ends
        the link (EOFError), as a peer's close would: the message's rest could no longer be told apart."""
        self._io_timeout = seconds
        self._sock.settimeout(seconds)

    def send(self, obj: Any) -> None:
        frames = encode(obj)
        with self._send_lock:
            head = _COUNT.pack(len(frames))
            for frame in frames:  # small frames ride with their length in one write (TCP_NODELAY is on)
                length = _LENGTH.pack(len(frame))
                if len(frame) < 64 * 1024:
                    self._sock.sendall(head + length + bytes(frame))
                else:
                    self._sock.sendall(head + length)
                    self._sock.sendall(frame)
                head = b""

    def recv(self) -> Any:
        """The next message; EOFError when the peer closed the link (or it broke), ProtocolError when it
        announces more than this end accepts."""
        (count,) = _COUNT.unpack(self._read(_COUNT.size))
        if not 1 <= count <= MAX_FRAMES:
            raise ProtocolError(f"control link from {self._peer}: a message of {count} frames (1..{MAX_FRAMES})")
        frames, budget = [], self.max_bytes
        for _ in range(count):
            (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
            if length > budget:
                raise ProtocolError(f"control link from {self._peer}: a message over {self.max_bytes} bytes (the cap "
                                    "is the model's state; sparse tables of hashed ids count ps.sparse.max_rows "
                                    "rows, 4M without it: set ps.sparse.max_rows to the rows a table may hold)")
            budget -= length
            frames.append(self._read(length))
        try:
            return decode(frames)
        except Exception as exc:  # noqa: BLE001 - whatever a malformed document raises, it is a protocol error
            raise ProtocolError(f"control link from {self._peer}: undecodable message: {type(exc).__name__}: "
                                f"{exc}") from None

    def _read(self, size: int) -> bytes:
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            try:
                n = self._sock.recv_into(view[got:])
            except TimeoutError:
                raise EOFError(f"the control link to {self._peer} stalled for {self._io_timeout:g}s inside a "
                               "message") from None
            except OSError:
                n = 0
            if n == 0:
                raise EOFError(f"the control link to {self._peer} closed")
            got += n
        return bytes(buffer)

    def poll(self, timeout: float) -> bool:
        pending = getattr(self._sock, "pending", None)  # an ssl socket may hold decrypted bytes already
        if pending is not None and pending():
            return True
        try:
            ready, _, _ = select.select([self._sock], [], [], timeout)
        except (OSError, ValueError):  # closed meanwhile: the read says so
            return True
        return bool(ready)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def open_link(host: str, port: int, secret: bytes, *, host_index: int, channel: int, generation: int,
              timeout: Timeout, max_bytes: int, tls: Optional["PinnedCert"] = None) -> Link:
    """The shard process's side: connect to the driver's registry, TLS with ``ps.tls``, the mutual
    handshake; a Link, or PSError / PSTimeoutError naming the registry and ``timeout``'s key."""
    from pipeline.errors import AuthenticationError
    from pipeline.wire.frames import Channel, PeerClosedError
    from pipeline.wire.handshake import PeerRefused, client_handshake
    from pipeline.wire.sockets import connect

    who = f"the parameter server shard of host {host_index}"
    peer = "the driver's shard registry"
    deadline = deadline_after(timeout)
    sock = connect(host, port, timeout, who=who, peer=peer)
    try:
        if tls is not None:
            from pipeline.wire.tls import wrap_client

            sock = wrap_client(sock, tls, deadline=deadline, peer=peer)
        sock.settimeout(remaining(deadline))
        client_handshake(Channel(sock), secret, rank=link_rank(host_index, channel), generation=generation,
                         deadline=deadline, mutual=True, peer=peer)
    except PeerRefused as exc:
        sock.close()
        raise AuthenticationError(f"{peer} at {host}:{port} refused {who}: {exc.reason}") from None
    except TimeoutError:
        sock.close()
        raise timeout.error(f"{who} to authenticate with {peer} at {host}:{port}") from None
    except (PeerClosedError, OSError, ProtocolError) as exc:
        sock.close()
        raise PSError(f"{who} could not open its control link to {peer} at {host}:{port}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    return Link(sock, max_bytes=max_bytes, peer=f"{peer} at {host}:{port}")
