"""Property-based fuzzing of the *connecting* side (hypothesis): a fake listener on 127.0.0.1 answers a real
``PSClient`` / ``connect_link`` with hostile bytes at each step of the mutual handshake — instead of the
CHALLENGE, instead of its proof (it does not hold the secret), and, holding the secret, a WELCOME that
lies (sizes, shard layouts, malformed JSON). Every connector must refuse with a PSError naming the
problem (never another exception, never a connection), and allocate nothing near what the frames claim.

Examples per run: 3 x 60 at the PS client, 60 at the stage link connector.
"""
from __future__ import annotations

import json
import socket
import threading
import tracemalloc
from typing import Callable, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import PSError
from pipeline.parallel.link import connect_link
from pipeline.ps import PSClient, new_secret
from pipeline.ps.transport.protocol import Channel, MsgType
from pipeline.wire.deadline import deadline_after
from pipeline.wire.frames import HEADER, MAGIC, NONCE_SIZE, PROTOCOL_VERSION, U32_MAX
from pipeline.wire.handshake import answer

N_PARAMS = 16
BIG_BYTES = 32 << 20
FUZZ = dict(deadline=None, database=None, max_examples=60,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SIZES = st.one_of(st.integers(0, 64), st.sampled_from([2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]),
                  st.integers(0, 2**64 - 1))


def raw_header(*, type_code: int, magic: bytes = MAGIC, version: int = PROTOCOL_VERSION, generation: int = 1,
               rank: int = 0, step: int = 0, dtype: int = 0, count: int = 0, length: int = 0) -> bytes:
    return HEADER.pack(magic, version, type_code, generation, rank, step, dtype, count, length)


@st.composite
def hostile_frame(draw) -> bytes:
    """Random bytes, or a header of any type with any sizes, optionally with a short payload."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    header = raw_header(type_code=draw(st.integers(0, 20)), magic=draw(st.sampled_from([MAGIC, b"SHPL", b"\0" * 4])),
                        generation=draw(st.integers(0, U32_MAX)), rank=draw(st.integers(0, U32_MAX)),
                        dtype=draw(st.integers(0, 6)), count=draw(SIZES), length=draw(SIZES))
    return header + draw(st.binary(max_size=64))


@st.composite
def lying_welcome(draw) -> bytes:
    """A WELCOME frame from a listener holding the secret: sizes never this model's, or a broken layout."""
    body: object
    kind = draw(st.sampled_from(["size", "shards", "json", "buffers"]))
    if kind == "size":
        body = {"num_params": draw(SIZES.filter(lambda n: n != N_PARAMS)), "version": 0, "world_size": 1}
    elif kind == "buffers":
        body = {"num_params": N_PARAMS, "version": 0, "world_size": 1,
                "buffer_words": draw(st.integers(1, 2**40).filter(lambda n: n != 4))}
    elif kind == "shards":
        cuts = sorted(draw(st.lists(st.integers(-5, N_PARAMS + 5), min_size=1, max_size=70)))
        shards = [{"host": "127.0.0.1", "port": 1, "start": a, "end": b} for a, b in zip([0] + cuts, cuts)]
        if shards and shards[-1]["end"] == N_PARAMS and len(shards) <= 64 and all(
                s["end"] > s["start"] for s in shards):
            shards[-1]["end"] = N_PARAMS + 1  # a valid layout would connect onwards: keep it broken
        body = {"num_params": N_PARAMS, "version": 0, "world_size": 1, "shards": shards}
    else:
        data = draw(st.one_of(st.binary(max_size=100), st.just(b"[" * 50_000),
                              st.just(json.dumps([1, 2]).encode())))
        return raw_header(type_code=MsgType.WELCOME, length=len(data)) + data
    data = json.dumps(body).encode()
    return raw_header(type_code=MsgType.WELCOME, length=len(data)) + data


class Listener:
    """One fake listener; ``script(channel)`` serves each connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        self.script: Optional[Callable[[Channel], None]] = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            channel = Channel(conn, max_elements=1 << 40)
            try:
                assert self.script is not None
                self.script(channel)
                conn.shutdown(socket.SHUT_WR)
                conn.settimeout(5)
                while conn.recv(65536):
                    pass
            except (OSError, PSError):
                pass
            finally:
                channel.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def listener():
    fake = Listener()
    yield fake
    fake.close()


def _read_client_challenge(channel: Channel) -> bytes:
    deadline = deadline_after(5)
    header = channel.recv_header(deadline)
    channel.recv_bytes(header, deadline)  # AUTH, unchecked
    header = channel.recv_header(deadline)
    assert header.type is MsgType.CHALLENGE
    return channel.recv_bytes(header, deadline)


def _refused(connect: Callable[[], object]) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(PSError):
            result = connect()
            close = getattr(result, "close", None)
            if close is not None:
                close()
        assert tracemalloc.get_traced_memory()[1] < BIG_BYTES
    finally:
        tracemalloc.stop()


def _client(listener: Listener, secret: bytes) -> PSClient:
    return PSClient(*listener.address, rank=0, secret=secret, timeout_s=1.0, expected_params=N_PARAMS,
                    expected_buffer_words=4)


@pytest.mark.parametrize("where", ["instead_of_challenge", "instead_of_proof"])
def test_the_ps_client_refuses_hostile_handshake_frames(listener, where) -> None:
    @settings(**FUZZ)
    @given(frame=hostile_frame())
    def prop(frame: bytes) -> None:
        def script(channel: Channel) -> None:
            if where == "instead_of_proof":
                channel.send_bytes(MsgType.CHALLENGE, b"n" * NONCE_SIZE, generation=1, rank=0, timeout=5)
                _read_client_challenge(channel)
            channel.sock.sendall(frame)

        listener.script = script
        client = _client(listener, new_secret())
        try:
            _refused(client.connect)
        finally:
            client.close()

    prop()


def test_the_ps_client_refuses_a_lying_welcome_from_a_secret_holder(listener) -> None:
    secret = new_secret()

    @settings(**FUZZ)
    @given(frame=lying_welcome())
    def prop(frame: bytes) -> None:
        def script(channel: Channel) -> None:
            channel.send_bytes(MsgType.CHALLENGE, b"n" * NONCE_SIZE, generation=1, rank=0, timeout=5)
            answer(channel, secret, _read_client_challenge(channel), generation=1, rank=0, deadline=None)
            channel.sock.sendall(frame)

        listener.script = script
        client = _client(listener, secret)
        try:
            _refused(client.connect)
        finally:
            client.close()

    prop()


def test_the_stage_link_connector_refuses_hostile_handshake_frames(listener) -> None:
    @settings(**FUZZ)
    @given(frame=hostile_frame(), after_challenge=st.booleans())
    def prop(frame: bytes, after_challenge: bool) -> None:
        def script(channel: Channel) -> None:
            if after_challenge:
                channel.send_bytes(MsgType.CHALLENGE, b"n" * NONCE_SIZE, generation=1, rank=0, timeout=5)
                _read_client_challenge(channel)
            channel.sock.sendall(frame)

        listener.script = script
        _refused(lambda: connect_link(*listener.address, b"link-secret", 1, stage=0, rank=0, timeout_s=1.0))

    prop()
