"""The parameter-server wire: fixed binary header + raw little-endian payload over TCP.

Why a hand-rolled frame and not object serialization/RPC: the PS listens on the driver and must
never execute or deserialize arbitrary objects from the network. Every frame is a fixed-size
header whose fields are validated (magic, version, type, dtype, element count, payload length,
size caps) *before* a single payload byte is read, so a malformed or hostile peer can neither
desynchronise the stream silently nor make the receiver allocate unbounded memory. Tensor
payloads are raw bytes viewed with ``torch.frombuffer``; JSON payloads (metrics, errors) are
capped at 1 MiB.

Header layout (little-endian, 48 bytes)::

    magic 4s | version u8 | type u8 | pad 2 | generation u32 | rank u32 | step i64 |
    dtype u8 | pad 7 | count u64 | length u64
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import struct
import sys
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Union

import torch

from pipeline.errors import PSError, ProtocolError

logger = logging.getLogger(__name__)

MAGIC = b"SHPS"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBxxIIqB7xQQ")
HEADER_SIZE = HEADER.size
NONCE_SIZE = 32
MAC_SIZE = 32  # HMAC-SHA256
MAX_JSON_BYTES = 1 << 20
U32_MAX = 2**32 - 1

Buffer = Union[bytes, bytearray, memoryview]


class MsgType(IntEnum):
    """Message types. Direction is noted because each side rejects frames it should never receive."""

    CHALLENGE = 1  # server -> client: 32-byte nonce
    AUTH = 2  # client -> server: HMAC-SHA256(secret, nonce | rank | generation)
    WELCOME = 3  # server -> client: JSON {num_params, version, world_size, generation}
    PULL = 4  # client -> server: step = minimum version wanted
    PARAMS = 5  # server -> client: tensor, step = version
    PUSH = 6  # client -> server: gradient tensor for `step`
    ACK = 7  # server -> client
    METRICS = 8  # client -> server: JSON dict
    FAIL = 9  # client -> server: JSON {error, log_tail}
    FINISH = 10  # client -> server
    ERROR = 11  # server -> client: JSON {error, kind}
    # client -> server: PUSH for `step` whose reply is the PARAMS a PULL(step + 1) would get (one round
    # trip per synchronous step instead of two; sync/average/ssp only). Refusals come back as ERROR.
    PUSH_PULL = 12


class DType(IntEnum):
    """Element type of a tensor payload. fp16/bf16/sparse are only accepted for compressed pushes.

    ``SPARSE_F32`` is a top-k payload: ``count`` int32 indices followed by ``count`` fp32 values
    (8 bytes per element), so the same header fields bound it as a dense payload.
    """

    NONE = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    SPARSE_F32 = 4


ITEMSIZE: dict[DType, int] = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.SPARSE_F32: 8}
TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}
DTYPE_OF_TORCH: dict[torch.dtype, DType] = {v: k for k, v in TORCH_DTYPES.items()}
# What a receiver accepts today; widen this when a compressed mode lands.
DEFAULT_TENSOR_DTYPES = frozenset({DType.FLOAT32})

TENSOR_TYPES = frozenset({MsgType.PARAMS, MsgType.PUSH, MsgType.PUSH_PULL})
JSON_TYPES = frozenset({MsgType.WELCOME, MsgType.METRICS, MsgType.FAIL, MsgType.ERROR})
FIXED_SIZE_TYPES: dict[MsgType, int] = {MsgType.CHALLENGE: NONCE_SIZE, MsgType.AUTH: MAC_SIZE}
EMPTY_TYPES = frozenset({MsgType.PULL, MsgType.ACK, MsgType.FINISH})


class PeerClosedError(PSError):
    """The peer closed the connection cleanly between two frames."""


@dataclass(frozen=True)
class Header:
    """One decoded, validated frame header."""

    type: MsgType
    generation: int
    rank: int
    step: int = 0
    dtype: DType = DType.NONE
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


def decode_header(
    data: Buffer,
    *,
    max_elements: int,
    tensor_dtypes: frozenset[DType] = DEFAULT_TENSOR_DTYPES,
) -> Header:
    """Parse and validate a header. ``max_elements`` caps tensor payloads (the parameter count).

    Everything that decides how many bytes to read next is checked here, so the caller may read
    exactly ``header.length`` bytes afterwards without further thought.
    """
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, type_code, generation, rank, step, dtype_code, count, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a shardline PS peer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION}); "
            "driver and workers must run the same shardline version"
        )
    try:
        msg_type = MsgType(type_code)
    except ValueError:
        raise ProtocolError(f"unknown message type {type_code}") from None
    try:
        dtype = DType(dtype_code)
    except ValueError:
        raise ProtocolError(f"unknown dtype code {dtype_code} in {msg_type.name} frame") from None

    if msg_type in TENSOR_TYPES:
        if dtype not in tensor_dtypes:
            raise ProtocolError(
                f"dtype {dtype.name} is not accepted for {msg_type.name} "
                f"(accepted: {', '.join(sorted(d.name for d in tensor_dtypes))})"
            )
        if count > max_elements:
            raise ProtocolError(
                f"{msg_type.name} frame announces {count} elements, more than the {max_elements} "
                "parameters this connection expects"
            )
        if length != count * ITEMSIZE[dtype]:
            raise ProtocolError(
                f"{msg_type.name} payload length {length} != count {count} * itemsize "
                f"{ITEMSIZE[dtype]} ({dtype.name})"
            )
    else:
        if dtype is not DType.NONE or count != 0:
            raise ProtocolError(f"{msg_type.name} frame must not carry a dtype or element count")
        if msg_type in FIXED_SIZE_TYPES:
            if length != FIXED_SIZE_TYPES[msg_type]:
                raise ProtocolError(
                    f"{msg_type.name} payload must be {FIXED_SIZE_TYPES[msg_type]} bytes, got {length}"
                )
        elif msg_type in JSON_TYPES:
            if length > MAX_JSON_BYTES:
                raise ProtocolError(
                    f"{msg_type.name} JSON payload of {length} bytes exceeds the {MAX_JSON_BYTES} byte cap"
                )
        elif length != 0:
            raise ProtocolError(f"{msg_type.name} frame must have an empty payload, got {length} bytes")
    return Header(msg_type, generation, rank, step, dtype, count, length)


def auth_mac(secret: bytes, nonce: bytes, rank: int, generation: int) -> bytes:
    """HMAC-SHA256(secret, nonce ‖ rank u32 LE ‖ generation u32 LE): binds the proof to one
    connection (fresh nonce), one rank and one generation so it cannot be replayed elsewhere."""
    return hmac.new(secret, nonce + struct.pack("<II", rank, generation), hashlib.sha256).digest()


def verify_mac(secret: bytes, nonce: bytes, rank: int, generation: int, mac: Buffer) -> bool:
    """Constant-time check of an AUTH payload."""
    return hmac.compare_digest(auth_mac(secret, nonce, rank, generation), bytes(mac))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU, contiguous, 1-D tensor (the wire is little-endian)."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in the fleet
        raise PSError("the PS wire needs a little-endian host")
    if tensor.dim() != 1 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise PSError("tensor payloads must be 1-D, contiguous and on the CPU")
    if tensor.dtype not in DTYPE_OF_TORCH:
        raise PSError(f"tensor dtype {tensor.dtype} has no wire code")
    return memoryview(tensor.detach().view(torch.uint8).numpy()).cast("B")


def decode_tensor(payload: Buffer, header: Header) -> torch.Tensor:
    """View a received tensor payload without copying. The tensor aliases ``payload``."""
    if header.type not in TENSOR_TYPES:
        raise ProtocolError(f"{header.type.name} frame carries no tensor")
    if header.count == 0:
        return torch.empty(0, dtype=TORCH_DTYPES[header.dtype])
    return torch.frombuffer(payload, dtype=TORCH_DTYPES[header.dtype], count=header.count)


SOCKET_BUFFER_BYTES = 4 << 20


def set_buffer_sizes(sock: socket.socket, size: int = SOCKET_BUFFER_BYTES) -> None:
    """Kernel send/receive buffers that hold a whole multi-MB tensor frame, so a frame moves in a few
    large copies instead of many window-sized ones (the kernel caps this at net.core.[rw]mem_max)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            if sock.getsockopt(socket.SOL_SOCKET, opt) < size:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
        except OSError:  # pragma: no cover - platform without the option
            pass


def set_socket_options(sock: socket.socket) -> None:
    """TCP_NODELAY (small control frames must not wait for Nagle), large buffers and keepalive (so a
    vanished host is eventually noticed even when the other side is idle)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_buffer_sizes(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:  # pragma: no cover - platform without the option
                pass


def deadline_after(seconds: float | None) -> float | None:
    """Monotonic deadline ``seconds`` from now; None means wait without limit."""
    return None if seconds is None else time.monotonic() + seconds


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


class Channel:
    """One framed TCP connection: sends/receives frames, owns the reusable header buffer and counts
    bytes. Not thread-safe: exactly one thread reads and writes a channel."""

    def __init__(self, sock: socket.socket, *, max_elements: int = 0) -> None:
        self.sock = sock
        self.max_elements = max_elements
        self.bytes_sent = 0
        self.bytes_received = 0
        self._header_buf = bytearray(HEADER_SIZE)
        self._header_view = memoryview(self._header_buf)

    # -- sending -----------------------------------------------------------------------------
    def send(self, header: Header, payload: Buffer | None = None, *, timeout: float | None) -> None:
        """Send header then payload with ``sendall`` (timeout is the total for the frame)."""
        body = b"" if payload is None else payload
        if len(body) != header.length:
            raise PSError(f"{header.type.name} payload is {len(body)} bytes, header says {header.length}")
        packed = header.pack()
        self.sock.settimeout(timeout)
        if not header.length:
            self.sock.sendall(packed)
        elif header.length <= 64 * 1024:
            # One segment for small frames; large tensors go out from their own memory.
            self.sock.sendall(packed + bytes(body))
        else:
            # Header and payload in one syscall (no copy of the payload); the rest, if any, by sendall.
            deadline = deadline_after(timeout)
            sent = self.sock.sendmsg([packed, body])
            if sent < HEADER_SIZE:
                self.sock.settimeout(_remaining(deadline))
                self.sock.sendall(packed[sent:])
                sent = HEADER_SIZE
            if sent < HEADER_SIZE + header.length:
                self.sock.settimeout(_remaining(deadline))
                self.sock.sendall(memoryview(body).cast("B")[sent - HEADER_SIZE:])
        self.bytes_sent += HEADER_SIZE + header.length

    def send_empty(self, msg_type: MsgType, *, generation: int, rank: int, step: int = 0,
                   timeout: float | None) -> None:
        self.send(Header(msg_type, generation, rank, step), timeout=timeout)

    def send_bytes(self, msg_type: MsgType, data: bytes, *, generation: int, rank: int,
                   timeout: float | None) -> None:
        self.send(Header(msg_type, generation, rank, 0, DType.NONE, 0, len(data)), data, timeout=timeout)

    def send_json(self, msg_type: MsgType, obj: dict[str, Any], *, generation: int, rank: int,
                  step: int = 0, timeout: float | None) -> None:
        data = encode_json(obj)
        self.send(Header(msg_type, generation, rank, step, DType.NONE, 0, len(data)), data, timeout=timeout)

    def send_tensor(self, msg_type: MsgType, tensor: torch.Tensor, *, generation: int, rank: int,
                    step: int, timeout: float | None) -> None:
        view = tensor_bytes(tensor)
        header = Header(msg_type, generation, rank, step, DTYPE_OF_TORCH[tensor.dtype],
                        tensor.numel(), view.nbytes)
        self.send(header, view, timeout=timeout)

    def send_payload(self, msg_type: MsgType, payload: memoryview, dtype: DType, count: int, *,
                     generation: int, rank: int, step: int, timeout: float | None) -> None:
        """Send an already encoded tensor payload (compressed pushes: fp16/bf16/sparse)."""
        header = Header(msg_type, generation, rank, step, dtype, count, payload.nbytes)
        self.send(header, payload, timeout=timeout)

    # -- receiving ---------------------------------------------------------------------------
    def _recv_exact(self, view: memoryview, deadline: float | None, *, frame_start: bool) -> None:
        got = 0
        total = len(view)
        sock = self.sock
        if deadline is None:
            sock.settimeout(None)
        while got < total:
            if deadline is not None:
                sock.settimeout(_remaining(deadline))
            n = sock.recv_into(view[got:] if got else view, total - got)
            if n == 0:
                if frame_start and got == 0:
                    raise PeerClosedError("peer closed the connection")
                raise ProtocolError(f"truncated frame: connection closed after {got} of {total} bytes")
            got += n
            self.bytes_received += n

    def recv_header(self, deadline: float | None, *,
                    tensor_dtypes: frozenset[DType] = DEFAULT_TENSOR_DTYPES) -> Header:
        """Read and validate the next header; raises PeerClosedError on a clean EOF."""
        self._recv_exact(self._header_view, deadline, frame_start=True)
        return decode_header(self._header_buf, max_elements=self.max_elements,
                             tensor_dtypes=tensor_dtypes)

    def recv_into(self, header: Header, buffer: bytearray, deadline: float | None) -> memoryview:
        """Read the payload of ``header`` into the front of a preallocated buffer."""
        if header.length > len(buffer):
            raise ProtocolError(
                f"{header.type.name} payload of {header.length} bytes exceeds the {len(buffer)} byte buffer"
            )
        view = memoryview(buffer)[: header.length]
        self._recv_exact(view, deadline, frame_start=False)
        return view

    def recv_bytes(self, header: Header, deadline: float | None) -> bytes:
        """Read a small (already size-validated) payload into fresh bytes."""
        buf = bytearray(header.length)
        self._recv_exact(memoryview(buf), deadline, frame_start=False)
        return bytes(buf)

    def recv_json(self, header: Header, deadline: float | None) -> dict[str, Any]:
        """Read a JSON object payload (capped at MAX_JSON_BYTES by decode_header)."""
        if header.type not in JSON_TYPES:
            raise ProtocolError(f"{header.type.name} frame carries no JSON")
        return decode_json(self.recv_bytes(header, deadline), header.type)

    def skip(self, header: Header, deadline: float | None) -> None:
        """Discard a (validated, bounded) payload to keep the stream in sync."""
        left = header.length
        chunk = bytearray(min(left, 64 * 1024) or 1)
        while left:
            view = memoryview(chunk)[: min(left, len(chunk))]
            self._recv_exact(view, deadline, frame_start=False)
            left -= len(view)

    def close(self) -> None:
        """Shut down then close; shutdown wakes a thread blocked in recv on this socket."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass


def encode_json(obj: dict[str, Any]) -> bytes:
    """UTF-8 JSON; raises PSError past the 1 MiB cap so the peer never has to reject it."""
    data = json.dumps(obj, separators=(",", ":"), default=str).encode("utf-8")
    if len(data) > MAX_JSON_BYTES:
        raise PSError(f"JSON message of {len(data)} bytes exceeds the {MAX_JSON_BYTES} byte cap")
    return data


def decode_json(data: bytes, msg_type: MsgType) -> dict[str, Any]:
    """Parse a JSON object payload; anything else is a protocol error.

    Deeply nested JSON (``[[[[...``, a few kB suffice) makes the parser raise RecursionError, which is
    no ValueError: uncaught, it escaped the server's per-connection error handling, so the rank was
    neither told why nor recorded as failed. It is a protocol error like any other malformed payload.
    """
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"{msg_type.name} payload is not valid UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"{msg_type.name} payload nests JSON too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{msg_type.name} payload must be a JSON object, got {type(obj).__name__}")
    return obj
