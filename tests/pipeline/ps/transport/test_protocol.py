"""The PS protocol over the wire: header round trips, PS header validation before any payload byte, zero-copy
tensors, the PS Channel. (HMAC, JSON payloads and raw framing: tests/pipeline/wire.)"""
from __future__ import annotations

import socket
import struct

import pytest
import torch

from pipeline.errors import PSError, ProtocolError
from pipeline.ps.transport import protocol as p
from pipeline.ps.transport.protocol import DType, Header, MsgType
from pipeline.wire import frames
from pipeline.wire.deadline import deadline_after


def raw_header(*, magic=frames.MAGIC, version=frames.PROTOCOL_VERSION, type_code=int(MsgType.PULL),
               generation=1, rank=0, step=0, dtype=0, count=0, length=0) -> bytes:
    return frames.HEADER.pack(magic, version, type_code, generation, rank, step, dtype, count, length)


def decode(data: bytes, max_elements: int = 10, **kw) -> Header:
    return p.decode_header(data, max_elements=max_elements, **kw)


@pytest.mark.parametrize("header", [
    Header(MsgType.CHALLENGE, 1, 0, length=frames.NONCE_SIZE),
    Header(MsgType.AUTH, 7, 3, length=frames.MAC_SIZE),
    Header(MsgType.WELCOME, 1, 2, length=100),
    Header(MsgType.PULL, 2**32 - 1, 2**32 - 1, step=2**63 - 1),
    Header(MsgType.PARAMS, 1, 0, step=5, dtype=DType.FLOAT32, count=10, length=40),
    Header(MsgType.PUSH, 1, 1, step=-1, dtype=DType.FLOAT32, count=3, length=12),
    Header(MsgType.ACK, 1, 0),
    Header(MsgType.METRICS, 1, 0, length=frames.MAX_JSON_BYTES),
    Header(MsgType.FAIL, 1, 0, length=10),
    Header(MsgType.FINISH, 1, 0),
    Header(MsgType.ERROR, 1, 0, length=5),
])
def test_header_round_trip(header: Header) -> None:
    packed = header.pack()
    assert len(packed) == frames.HEADER_SIZE == 48
    assert decode(packed) == header


def test_header_is_little_endian_with_magic_first() -> None:
    packed = Header(MsgType.PUSH, 0x01020304, 5, step=6, dtype=DType.FLOAT32, count=2, length=8).pack()
    assert packed[:4] == b"SHPS"
    assert packed[6:8] == b"\0\0"
    assert struct.unpack_from("<I", packed, 8)[0] == 0x01020304


@pytest.mark.parametrize("data, match", [
    (raw_header(magic=b"HTTP"), "bad magic"),
    (raw_header(version=2), "protocol version 2"),
    (raw_header(type_code=99), "unknown message type 99"),
    (raw_header(type_code=0), "unknown message type 0"),
    (raw_header(type_code=int(MsgType.PUSH), dtype=9, count=1, length=4), "unknown dtype"),
    # tensor frames: size capped by the known parameter count, length must equal count*itemsize
    (raw_header(type_code=int(MsgType.PUSH), dtype=1, count=11, length=44), "more than the 10"),
    (raw_header(type_code=int(MsgType.PUSH), dtype=1, count=2**62, length=2**64 - 8), "more than"),
    (raw_header(type_code=int(MsgType.PUSH), dtype=1, count=3, length=13), r"!= count 3 \* itemsize 4"),
    (raw_header(type_code=int(MsgType.PARAMS), dtype=1, count=3, length=6), "!= count"),
    (raw_header(type_code=int(MsgType.PUSH), dtype=0, count=3, length=12), "dtype NONE is not accepted"),
    (raw_header(type_code=int(MsgType.PUSH), dtype=2, count=3, length=6), "FLOAT16 is not accepted"),
    # non-tensor frames
    (raw_header(type_code=int(MsgType.METRICS), length=frames.MAX_JSON_BYTES + 1), "exceeds"),
    (raw_header(type_code=int(MsgType.ERROR), length=2**64 - 1), "exceeds"),
    (raw_header(type_code=int(MsgType.AUTH), length=31), "must be 32 bytes"),
    (raw_header(type_code=int(MsgType.CHALLENGE), length=1 << 30), "must be 32 bytes"),
    (raw_header(type_code=int(MsgType.PULL), length=1), "empty payload"),
    (raw_header(type_code=int(MsgType.ACK), dtype=1), "must not carry a dtype"),
    (raw_header(type_code=int(MsgType.FINISH), count=4), "must not carry a dtype"),
    (raw_header()[:-1], "must be 48 bytes"),
])
def test_header_validation_rejects(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_reserved_half_precision_codes_accepted_when_enabled() -> None:
    data = raw_header(type_code=int(MsgType.PUSH), dtype=int(DType.BFLOAT16), count=4, length=8)
    header = decode(data, tensor_dtypes=frozenset({DType.FLOAT32, DType.BFLOAT16}))
    assert header.dtype is DType.BFLOAT16 and header.count == 4


def test_pack_rejects_values_that_do_not_fit() -> None:
    with pytest.raises(ProtocolError, match="unsigned 32-bit"):
        Header(MsgType.PULL, 2**32, 0).pack()
    with pytest.raises(ProtocolError, match="signed 64-bit"):
        Header(MsgType.PULL, 0, 0, step=2**63).pack()


def test_tensor_bytes_and_decode_are_zero_copy() -> None:
    t = torch.arange(5, dtype=torch.float32)
    view = p.tensor_bytes(t)
    assert view.nbytes == 20 and bytes(view) == t.numpy().tobytes()
    t[0] = 42.0  # the view aliases the tensor: nothing was copied
    assert bytes(view[:4]) == struct.pack("<f", 42.0)

    buf = bytearray(bytes(view))
    header = Header(MsgType.PARAMS, 1, 0, dtype=DType.FLOAT32, count=5, length=20)
    decoded = p.decode_tensor(buf, header)
    assert torch.equal(decoded, t)
    buf[:4] = struct.pack("<f", -1.0)
    assert decoded[0].item() == -1.0


def test_tensor_bytes_rejects_non_contiguous_and_2d() -> None:
    with pytest.raises(PSError, match="1-D, contiguous"):
        p.tensor_bytes(torch.zeros(4, 2)[:, 0])
    with pytest.raises(PSError, match="1-D, contiguous"):
        p.tensor_bytes(torch.zeros(2, 2))


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ca, cb = p.Channel(a, max_elements=8), p.Channel(b, max_elements=8)
    yield ca, cb
    ca.close()
    cb.close()


def test_channel_tensor_and_json_round_trip(pair) -> None:
    ca, cb = pair
    grad = torch.linspace(-1, 1, 8)
    ca.send_tensor(MsgType.PUSH, grad, generation=3, rank=1, step=9, timeout=1)
    ca.send_json(MsgType.METRICS, {"loss": 0.5, "n": [1, 2]}, generation=3, rank=1, timeout=1)
    buf = bytearray(32)
    header = cb.recv_header(deadline_after(1))
    assert (header.type, header.generation, header.rank, header.step, header.count) == (
        MsgType.PUSH, 3, 1, 9, 8)
    payload = cb.recv_into(header, buf, deadline_after(1))
    assert torch.equal(p.decode_tensor(payload, header), grad)
    header = cb.recv_header(deadline_after(1))
    assert cb.recv_json(header, deadline_after(1)) == {"loss": 0.5, "n": [1, 2]}
    assert ca.bytes_sent == cb.bytes_received == 2 * frames.HEADER_SIZE + 32 + header.length


def test_channel_detects_clean_close_truncation_and_timeout(pair) -> None:
    ca, cb = pair
    with pytest.raises(TimeoutError):
        cb.recv_header(deadline_after(0.05))
    ca.sock.sendall(Header(MsgType.FAIL, 1, 0, length=10).pack() + b'{"err')
    header = cb.recv_header(deadline_after(1))
    ca.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="truncated frame"):
        cb.recv_json(header, deadline_after(1))
    with pytest.raises(frames.PeerClosedError):
        cb.recv_header(deadline_after(1))
