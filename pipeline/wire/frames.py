"""Framing: a fixed 48-byte header, validated before a payload byte is read, then raw little-endian bytes.

Why a hand-rolled frame and not object serialization/RPC: shardline listens on the driver and on
executors and must never execute or deserialize arbitrary objects from the network. Every frame is a
fixed-size header whose fields are validated (magic, version, type, dtype, element count, payload
length, size caps) *before* a single payload byte is read, so a malformed or hostile peer can neither
desynchronise the stream silently nor make the receiver allocate unbounded memory.

This module owns what every connection shares: the standard header layout (:class:`Header`), the
handshake frames every connection opens with (:class:`Control`), JSON payloads with their 1 MiB cap and
the :class:`Channel` (exact reads into caller buffers with deadlines, zero-copy sends, byte counts).
Which message types exist beyond the handshake, and how their headers are validated, is the business of
each protocol on top: the parameter server (``pipeline.ps.transport.protocol``) and the stage links
(``pipeline.parallel.link``, which has a header layout of its own of the same size).

Standard header layout (little-endian, 48 bytes)::

    magic 4s | version u8 | type u8 | pad 2 | generation u32 | rank u32 | step i64 |
    dtype u8 | pad 7 | count u64 | length u64
"""
from __future__ import annotations

import json
import socket
import struct
import sys
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional, Protocol, Union

from pipeline.errors import PSError, ProtocolError
from pipeline.wire.deadline import deadline_after, remaining

MAGIC = b"SHPS"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBxxIIqB7xQQ")
HEADER_SIZE = HEADER.size
NONCE_SIZE = 32
MAC_SIZE = 32  # HMAC-SHA256
MAX_JSON_BYTES = 1 << 20
U32_MAX = 2**32 - 1
# Frames up to this size go out as one segment (header and payload copied together); larger payloads
# are sent from their own memory.
_SMALL_FRAME = 64 * 1024
_SHM_MIN_BYTES = 64 * 1024  # pipeline.wire.shm.MIN_BYTES (kept here: the check is on every send)

Buffer = Union[bytes, bytearray, memoryview]


class Control(IntEnum):
    """The frames every connection's handshake is made of; protocols on top keep these codes."""

    CHALLENGE = 1  # listener -> connector (and, on mutual links, connector -> listener): 32-byte nonce
    AUTH = 2  # the answer: HMAC-SHA256(secret, nonce | rank | generation)
    ERROR = 11  # a refusal: JSON {error, kind}


class DType(IntEnum):
    """Element type code of a tensor payload (the header's dtype field; NONE for other frames).

    ``SPARSE_F32`` is a top-k payload: ``count`` int32 indices followed by ``count`` fp32 values
    (8 bytes per element), so the same header fields bound it as a dense payload.
    """

    NONE = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    SPARSE_F32 = 4


CONTROL_SIZES: dict[int, int] = {Control.CHALLENGE: NONCE_SIZE, Control.AUTH: MAC_SIZE}


class PeerClosedError(PSError):
    """The peer closed the connection cleanly between two frames."""


class Frame(Protocol):
    """What :meth:`Channel.send` needs of a header: its encoding, its payload length and a type name."""

    @property
    def length(self) -> int: ...

    def pack(self) -> bytes: ...


@dataclass(frozen=True)
class Header:
    """One standard frame header. ``type`` and ``dtype`` are the protocol's codes (IntEnums there)."""

    type: Any
    generation: int
    rank: int
    step: int = 0
    dtype: Any = DType.NONE
    count: int = 0
    length: int = 0

    def pack(self) -> bytes:
        """Encode; raises ProtocolError for values that do not fit their wire field."""
        if not (0 <= self.generation <= U32_MAX and 0 <= self.rank <= U32_MAX):
            raise ProtocolError(
                f"generation {self.generation} / rank {self.rank} must fit an unsigned 32-bit field"
            )
        if not -(2**63) <= self.step < 2**63:
            raise ProtocolError(f"step {self.step} does not fit a signed 64-bit field")
        if self.count < 0 or self.length < 0:
            raise ProtocolError("count and length must be >= 0")
        return HEADER.pack(
            MAGIC, PROTOCOL_VERSION, int(self.type), self.generation, self.rank, self.step,
            int(self.dtype), self.count, self.length,
        )


def unpack_header(data: Buffer) -> tuple[int, int, int, int, int, int, int]:
    """Size, magic and version of a standard header checked; returns (type code, generation, rank, step,
    dtype code, count, length) for the protocol's own validation."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, type_code, generation, rank, step, dtype_code, count, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a shardline peer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION}); "
            "driver and workers must run the same shardline version"
        )
    return type_code, generation, rank, step, dtype_code, count, length


def decode_control_header(data: Buffer) -> Header:
    """A handshake frame (CHALLENGE, AUTH or ERROR) and nothing else: what a connection accepts before
    it knows who is on the other end."""
    type_code, generation, rank, step, dtype_code, count, length = unpack_header(data)
    try:
        kind = Control(type_code)
    except ValueError:
        raise ProtocolError(f"message type {type_code} is not part of the handshake") from None
    if dtype_code != 0 or count != 0:
        raise ProtocolError(f"{kind.name} frame must not carry a dtype or element count")
    if kind in CONTROL_SIZES and length != CONTROL_SIZES[kind]:
        raise ProtocolError(f"{kind.name} payload must be {CONTROL_SIZES[kind]} bytes, got {length}")
    if kind is Control.ERROR and length > MAX_JSON_BYTES:
        raise ProtocolError(f"{kind.name} JSON payload of {length} bytes exceeds the {MAX_JSON_BYTES} byte cap")
    return Header(kind, generation, rank, step, DType.NONE, 0, length)


def _name(kind: Any) -> str:
    return getattr(kind, "name", str(kind))


def encode_json(obj: dict[str, Any]) -> bytes:
    """UTF-8 JSON; raises PSError past the 1 MiB cap so the peer never has to reject it."""
    data = json.dumps(obj, separators=(",", ":"), default=str).encode("utf-8")
    if len(data) > MAX_JSON_BYTES:
        raise PSError(f"JSON message of {len(data)} bytes exceeds the {MAX_JSON_BYTES} byte cap")
    return data


def decode_json(data: bytes, msg_type: Any) -> dict[str, Any]:
    """Parse a JSON object payload; anything else is a protocol error.

    Deeply nested JSON (``[[[[...``, a few kB suffice) makes the parser raise RecursionError, which is
    no ValueError: uncaught, it escaped the server's per-connection error handling, so the rank was
    neither told why nor recorded as failed. It is a protocol error like any other malformed payload.
    """
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"{_name(msg_type)} payload is not valid UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"{_name(msg_type)} payload nests JSON too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{_name(msg_type)} payload must be a JSON object, got {type(obj).__name__}")
    return obj


def tensor_view(tensor: Any) -> memoryview:
    """A zero-copy byte view of a CPU, contiguous, 1-D tensor (the wire is little-endian)."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in the fleet
        raise PSError("the shardline wire needs a little-endian host")
    if tensor.dim() != 1 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise PSError("tensor payloads must be 1-D, contiguous and on the CPU")
    import torch  # the caller holds a tensor, so this is a dict lookup; the wire does not need torch to load

    return memoryview(tensor.detach().view(torch.uint8).numpy()).cast("B")


class Channel:
    """One framed TCP connection: sends/receives frames, owns the reusable header buffer and counts
    bytes. Not thread-safe: exactly one thread reads and writes a channel.

    ``recv_header`` decodes handshake frames only; a protocol's channel overrides it with its own
    validation (``max_elements`` is the cap it enforces on tensor frames)."""

    def __init__(self, sock: socket.socket, *, max_elements: int = 0) -> None:
        self.sock = sock
        self.max_elements = max_elements
        self.bytes_sent = 0
        self.bytes_received = 0
        self._header_buf = bytearray(HEADER_SIZE)
        self._header_view = memoryview(self._header_buf)
        # ps.shared_memory_mb: both ends mapped one segment (pipeline.wire.shm); large payloads go
        # through its rings, their headers still on the socket. None: every byte on the socket.
        self.shm: Any = None
        self.shm_bytes_sent = 0
        self.shm_bytes_received = 0
        self._shm_left = 0  # bytes of the current ring payload not read yet
        self._ring_in: Any = None  # the ring (or gradient slot) that payload lies in
        self._descriptor = bytearray(8)

    # -- sending -----------------------------------------------------------------------------
    def send(self, header: Frame, payload: Optional[Buffer] = None, *, timeout: Optional[float]) -> None:
        """Send header then payload with ``sendall`` (timeout is the total for the frame)."""
        body = b"" if payload is None else payload
        if len(body) != header.length:
            raise PSError(f"{_name(getattr(header, 'type', 'frame'))} payload is {len(body)} bytes, "
                          f"header says {header.length}")
        packed = header.pack()
        self.sock.settimeout(timeout)
        if self.shm is not None and header.length >= _SHM_MIN_BYTES and self._send_via_ring(packed, body, header.length):
            return
        if not header.length:
            self.sock.sendall(packed)
        elif header.length <= _SMALL_FRAME:
            # One segment for small frames; large tensors go out from their own memory.
            self.sock.sendall(packed + bytes(body))
        else:
            # Header and payload in one syscall (no copy of the payload); the rest, if any, by sendall.
            deadline = deadline_after(timeout)
            try:
                sent = self.sock.sendmsg([packed, body])
            except NotImplementedError:  # a TLS socket (ps.tls): its own buffering, one sendall each
                self.sock.sendall(packed)
                self.sock.settimeout(remaining(deadline))
                self.sock.sendall(body)
                self.bytes_sent += HEADER_SIZE + header.length
                return
            if sent < HEADER_SIZE:
                self.sock.settimeout(remaining(deadline))
                self.sock.sendall(packed[sent:])
                sent = HEADER_SIZE
            if sent < HEADER_SIZE + header.length:
                self.sock.settimeout(remaining(deadline))
                self.sock.sendall(memoryview(body).cast("B")[sent - HEADER_SIZE:])
        self.bytes_sent += HEADER_SIZE + header.length

    def _send_via_ring(self, packed: bytes, body: Buffer, header_length: int) -> bool:
        from pipeline.wire import shm

        slot = self.shm.slot_out
        end = None if slot is None else slot.put(body, in_place_only=True)  # written there by autograd
        flag = shm.IN_SLOT
        if end is None:
            end, flag = self.shm.out.put(body), shm.IN_RING
        if end is None:
            return False  # the ring is full: inline, never a wait
        flagged = bytearray(packed)
        flagged[shm.FLAG_OFFSET] = flag
        self.sock.sendall(flagged + shm.DESCRIPTOR.pack(end))
        self.bytes_sent += HEADER_SIZE + header_length
        self.shm_bytes_sent += header_length
        return True

    def send_empty(self, msg_type: Any, *, generation: int, rank: int, step: int = 0,
                   timeout: Optional[float]) -> None:
        self.send(Header(msg_type, generation, rank, step), timeout=timeout)

    def send_bytes(self, msg_type: Any, data: bytes, *, generation: int, rank: int,
                   timeout: Optional[float]) -> None:
        self.send(Header(msg_type, generation, rank, 0, DType.NONE, 0, len(data)), data, timeout=timeout)

    def send_json(self, msg_type: Any, obj: dict[str, Any], *, generation: int, rank: int,
                  step: int = 0, timeout: Optional[float]) -> None:
        data = encode_json(obj)
        self.send(Header(msg_type, generation, rank, step, DType.NONE, 0, len(data)), data, timeout=timeout)

    def send_payload(self, msg_type: Any, payload: memoryview, dtype: Any, count: int, *,
                     generation: int, rank: int, step: int, timeout: Optional[float]) -> None:
        """Send an already encoded tensor payload (e.g. compressed pushes: fp16/bf16/sparse)."""
        header = Header(msg_type, generation, rank, step, dtype, count, payload.nbytes)
        self.send(header, payload, timeout=timeout)

    # -- receiving ---------------------------------------------------------------------------
    def _recv_exact(self, view: memoryview, deadline: Optional[float], *, frame_start: bool) -> None:
        if self._shm_left and not frame_start:
            self._take_from_ring(view)
            return
        got = 0
        total = len(view)
        sock = self.sock
        if deadline is None:
            sock.settimeout(None)
        while got < total:
            if deadline is not None:
                sock.settimeout(remaining(deadline))
            n = sock.recv_into(view[got:] if got else view, total - got)
            if n == 0:
                if frame_start and got == 0:
                    raise PeerClosedError("peer closed the connection")
                raise ProtocolError(f"truncated frame: connection closed after {got} of {total} bytes")
            got += n
            self.bytes_received += n

    def recv_exact(self, view: memoryview, deadline: Optional[float]) -> None:
        """Fill ``view`` from the stream (a payload whose header was validated): no allocation."""
        self._recv_exact(view, deadline, frame_start=False)

    def recv_header_bytes(self, deadline: Optional[float]) -> bytearray:
        """Read the next 48 header bytes into the reusable buffer (PeerClosedError on a clean EOF);
        the caller decodes them with its protocol's validation before reading any payload."""
        if self._shm_left:
            raise ProtocolError(f"a new frame began with {self._shm_left} bytes of a shared-memory payload unread")
        self._recv_exact(self._header_view, deadline, frame_start=True)
        # pipeline.wire.shm.FLAG_OFFSET: the payload is in the ring. Without rings that byte stays what it
        # always was, padding (a peer's stray bits there are no error of their own).
        if self._header_buf[6] and self.shm is not None:
            # A frame at all first (magic, version): that is the error to name; its last field is the length.
            self._begin_ring_payload(unpack_header(self._header_buf)[-1], deadline)
        return self._header_buf

    def _begin_ring_payload(self, length: int, deadline: Optional[float]) -> None:
        from pipeline.wire import shm

        flag = self._header_buf[shm.FLAG_OFFSET]
        self._header_buf[shm.FLAG_OFFSET] = 0
        ring = self.shm.into if flag == shm.IN_RING else self.shm.slot_into if flag == shm.IN_SLOT else None
        if ring is None:
            raise ProtocolError(f"shared-memory flag {flag} names no ring of this connection")
        self._recv_exact(memoryview(self._descriptor), deadline, frame_start=False)
        (end,) = shm.DESCRIPTOR.unpack(self._descriptor)
        ring.begin(end, length)
        self._ring_in = ring
        if length:
            self._shm_left = length
        else:
            ring.release()

    def _take_from_ring(self, view: memoryview) -> None:
        n = view.nbytes
        if n > self._shm_left:
            raise ProtocolError(f"read of {n} bytes past the {self._shm_left} left of a shared-memory payload")
        self._ring_in.take(view)
        self._shm_left -= n
        self.bytes_received += n
        if not self._shm_left:
            self._ring_in.release()
        # Counted after the release: a reader of the count may then rely on the ring space being free.
        self.shm_bytes_received += n

    def recv_header(self, deadline: Optional[float]) -> Header:
        """Read and validate the next header as a handshake frame; raises PeerClosedError on a clean EOF."""
        return decode_control_header(self.recv_header_bytes(deadline))

    def recv_into(self, header: Any, buffer: bytearray, deadline: Optional[float]) -> memoryview:
        """Read the payload of ``header`` into the front of a preallocated buffer."""
        if header.length > len(buffer):
            raise ProtocolError(
                f"{_name(header.type)} payload of {header.length} bytes exceeds the {len(buffer)} byte buffer"
            )
        view = memoryview(buffer)[: header.length]
        self._recv_exact(view, deadline, frame_start=False)
        return view

    def recv_in_place(self, header: Any) -> Any:
        """The payload of ``header`` where it lies in the shared-memory ring (a uint8 tensor), no copy,
        its space held from the writer until the next ``recv_in_place`` or ``drop_in_place``; None when
        the payload is not wholly in the ring (on the socket: read it with ``recv_into``)."""
        from pipeline.wire import shm

        if self.shm is None or not header.length or self._shm_left != header.length \
                or self._ring_in.read_offset % shm.PAYLOAD_ALIGN:
            return None  # a peer's unaligned payload is copied out instead
        ring = self._ring_in
        view = ring.view(header.length)
        ring.hold()
        self._shm_left = 0
        self.bytes_received += header.length
        ring.release()
        self.shm_bytes_received += header.length
        return view

    def drop_in_place(self) -> None:
        """The payload ``recv_in_place`` returned is no longer in use: its ring space comes free."""
        if self.shm is not None:
            self.shm.into.unhold()
            if self.shm.slot_into is not None:
                self.shm.slot_into.unhold()

    def recv_bytes(self, header: Any, deadline: Optional[float]) -> bytes:
        """Read a small (already size-validated) payload into fresh bytes."""
        buf = bytearray(header.length)
        self._recv_exact(memoryview(buf), deadline, frame_start=False)
        return bytes(buf)

    def recv_json(self, header: Any, deadline: Optional[float]) -> dict[str, Any]:
        """Read a JSON object payload (at most MAX_JSON_BYTES, whatever the decoder let through)."""
        if header.length > MAX_JSON_BYTES:
            raise ProtocolError(f"{_name(header.type)} JSON payload of {header.length} bytes exceeds the "
                                f"{MAX_JSON_BYTES} byte cap")
        return decode_json(self.recv_bytes(header, deadline), header.type)

    def skip(self, header: Any, deadline: Optional[float]) -> None:
        """Discard a (validated, bounded) payload to keep the stream in sync."""
        left = header.length
        chunk = bytearray(min(left, 64 * 1024) or 1)
        while left:
            view = memoryview(chunk)[: min(left, len(chunk))]
            self._recv_exact(view, deadline, frame_start=False)
            left -= len(view)

    def linger_close(self, seconds: float = 0.5, max_bytes: int = 64 * 1024) -> None:
        """Close after a refusal: stop sending, read what the peer already sent (up to ``max_bytes``, for
        at most ``seconds``) until it hangs up, then close. A close with unread bytes makes the kernel
        reset the connection, which can discard the ERROR frame before the peer reads it (a mutual
        handshake's connector has sent its CHALLENGE right behind the AUTH that was refused)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            deadline = deadline_after(seconds)
            left = max_bytes
            while left > 0:
                self.sock.settimeout(remaining(deadline))
                data = self.sock.recv(min(left, 16 * 1024))
                if not data:
                    break
                left -= len(data)
        except (OSError, ValueError):
            pass
        self.close()

    def close(self) -> None:
        """Shut down then close; shutdown wakes a thread blocked in recv on this socket."""
        link, self.shm = self.shm, None
        if link is not None:
            link.close()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass
