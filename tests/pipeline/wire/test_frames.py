"""Framing shared by every connection: the standard header, handshake-frame validation before any payload
byte, exact reads with deadlines, zero-copy sends, JSON payloads with their cap."""
from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from pipeline.errors import PSError, ProtocolError
from pipeline.wire import frames as f
from pipeline.wire.deadline import deadline_after
from pipeline.wire.frames import Channel, Control, DType, Header


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ca, cb = Channel(a, max_elements=8), Channel(b, max_elements=8)
    yield ca, cb
    ca.close()
    cb.close()


def raw(*, magic=f.MAGIC, version=f.PROTOCOL_VERSION, type_code=int(Control.CHALLENGE), generation=1, rank=0,
        step=0, dtype=0, count=0, length=f.NONCE_SIZE) -> bytes:
    return f.HEADER.pack(magic, version, type_code, generation, rank, step, dtype, count, length)


@pytest.mark.parametrize("header", [
    Header(Control.CHALLENGE, 1, 0, length=f.NONCE_SIZE),
    Header(Control.AUTH, 2**32 - 1, 2**32 - 1, step=-5, length=f.MAC_SIZE),
    Header(Control.ERROR, 7, 3, length=f.MAX_JSON_BYTES),
])
def test_handshake_frames_round_trip(header: Header) -> None:
    packed = header.pack()
    assert len(packed) == f.HEADER_SIZE == 48 and packed[:4] == b"SHPS"
    decoded = f.decode_control_header(packed)
    assert decoded == header and decoded.type is header.type and decoded.dtype is DType.NONE


@pytest.mark.parametrize("data, match", [
    (raw(magic=b"SHPL"), "bad magic"),
    (raw(version=2), "protocol version 2 is not supported"),
    (raw(type_code=4), "message type 4 is not part of the handshake"),
    (raw(type_code=0), "message type 0 is not part of the handshake"),
    (raw(dtype=1), "CHALLENGE frame must not carry a dtype"),
    (raw(type_code=int(Control.AUTH), count=3), "AUTH frame must not carry a dtype or element count"),
    (raw(length=1 << 30), "CHALLENGE payload must be 32 bytes, got 1073741824"),
    (raw(type_code=int(Control.AUTH), length=31), "AUTH payload must be 32 bytes"),
    (raw(type_code=int(Control.ERROR), length=2**64 - 1), "exceeds the 1048576 byte cap"),
    (raw()[:-1], "must be 48 bytes"),
])
def test_handshake_header_validation_rejects(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        f.decode_control_header(data)


def test_pack_rejects_values_that_do_not_fit() -> None:
    with pytest.raises(ProtocolError, match="unsigned 32-bit"):
        Header(Control.AUTH, 0, 2**32).pack()
    with pytest.raises(ProtocolError, match="signed 64-bit"):
        Header(Control.AUTH, 0, 0, step=-(2**63) - 1).pack()
    with pytest.raises(ProtocolError, match=">= 0"):
        Header(Control.AUTH, 0, 0, length=-1).pack()


def test_truncated_header_is_a_protocol_error(pair) -> None:
    ca, cb = pair
    ca.sock.sendall(f.MAGIC + b"\x01")
    ca.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="after 5 of 48 bytes"):
        cb.recv_header(deadline_after(1))


def test_clean_close_between_frames_and_a_deadline(pair) -> None:
    ca, cb = pair
    with pytest.raises(TimeoutError):
        cb.recv_header(deadline_after(0.05))
    ca.send_bytes(Control.CHALLENGE, b"n" * 32, generation=1, rank=2, timeout=1)
    header = cb.recv_header(deadline_after(1))
    assert (header.type, header.rank, cb.recv_bytes(header, deadline_after(1))) == (Control.CHALLENGE, 2, b"n" * 32)
    ca.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(f.PeerClosedError):
        cb.recv_header(deadline_after(1))


def test_json_round_trip_and_the_receive_cap(pair) -> None:
    ca, cb = pair
    ca.send_json(Control.ERROR, {"error": "no", "kind": "auth"}, generation=1, rank=0, timeout=1)
    header = cb.recv_header(deadline_after(1))
    assert cb.recv_json(header, deadline_after(1)) == {"error": "no", "kind": "auth"}
    with pytest.raises(ProtocolError, match="exceeds"):  # whatever a protocol's decoder let through
        cb.recv_json(Header(Control.ERROR, 1, 0, length=f.MAX_JSON_BYTES + 1), deadline_after(1))


@pytest.mark.parametrize("payload, match", [(b"\xff\xfe", "not valid UTF-8 JSON"), (b"[1, 2]", "JSON object")])
def test_json_payload_must_be_an_object(payload: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        f.decode_json(payload, Control.ERROR)


def test_deeply_nested_json_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="ERROR payload nests JSON too deeply"):
        f.decode_json(b"[" * 100_000, Control.ERROR)


def test_oversize_json_is_refused_before_sending() -> None:
    with pytest.raises(PSError, match="exceeds"):
        f.encode_json({"blob": "x" * f.MAX_JSON_BYTES})


def test_send_checks_the_payload_against_the_header(pair) -> None:
    ca, _ = pair
    with pytest.raises(PSError, match="AUTH payload is 3 bytes, header says 32"):
        ca.send(Header(Control.AUTH, 1, 0, length=32), b"abc", timeout=1)
    assert ca.bytes_sent == 0


def test_a_large_payload_goes_out_from_its_own_memory_and_in_order() -> None:
    """Past 64 KiB the payload is sent with sendmsg (no copy); a slow reader makes it partial."""
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    tensor = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    header = Header(Control.ERROR, 1, 0, step=9, length=tensor.numel() * 4)  # any fixed header will do
    got = bytearray(header.length)

    def read() -> None:
        head = bytearray(f.HEADER_SIZE)
        receiver.recv_exact(memoryview(head), deadline_after(10))
        assert bytes(head) == header.pack()
        receiver.recv_exact(memoryview(got), deadline_after(10))

    thread = threading.Thread(target=read)
    thread.start()
    sender.send(header, f.tensor_view(tensor), timeout=10)
    thread.join(10)
    assert sender.bytes_sent == receiver.bytes_received == f.HEADER_SIZE + header.length
    assert torch.equal(torch.frombuffer(got, dtype=torch.float32), tensor)
    sender.close()
    receiver.close()


def test_recv_into_refuses_a_payload_larger_than_the_buffer(pair) -> None:
    _, cb = pair
    with pytest.raises(ProtocolError, match="exceeds the 4 byte buffer"):
        cb.recv_into(Header(Control.AUTH, 1, 0, length=32), bytearray(4), deadline_after(1))


def test_skip_keeps_the_stream_in_sync(pair) -> None:
    ca, cb = pair
    ca.send_bytes(Control.AUTH, b"m" * 32, generation=1, rank=0, timeout=1)
    ca.send_bytes(Control.CHALLENGE, b"n" * 32, generation=1, rank=0, timeout=1)
    cb.skip(cb.recv_header(deadline_after(1)), deadline_after(1))
    header = cb.recv_header(deadline_after(1))
    assert header.type is Control.CHALLENGE and cb.recv_bytes(header, deadline_after(1)) == b"n" * 32


def test_tensor_view_is_zero_copy_and_refuses_what_it_cannot_view() -> None:
    t = torch.arange(4, dtype=torch.float32)
    view = f.tensor_view(t)
    t[0] = 42.0
    assert view.nbytes == 16 and bytes(view[:4]) == struct.pack("<f", 42.0)
    assert f.tensor_view(torch.ones(3, dtype=torch.bfloat16)).nbytes == 6
    with pytest.raises(PSError, match="1-D, contiguous"):
        f.tensor_view(torch.zeros(4, 2)[:, 0])
