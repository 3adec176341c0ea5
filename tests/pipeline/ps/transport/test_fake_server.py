"""A worker facing a FAKE parameter server: a real socket on 127.0.0.1 that either does not hold the job's
secret, or holds it and lies about sizes and shard addresses. The client must refuse with a clear error
before it allocates anything the fake announced (issue 19, item 1)."""
from __future__ import annotations

import socket
import threading
import tracemalloc
from typing import Callable

import pytest
import torch

from pipeline.errors import AuthenticationError, PSError, ProtocolError
from pipeline.ps import PSClient, new_secret
from pipeline.ps.transport.protocol import Channel, DType, Header, MsgType
from pipeline.wire.deadline import deadline_after
from pipeline.wire.frames import NONCE_SIZE, PeerClosedError
from pipeline.wire.handshake import answer, auth_mac

HUGE = 1 << 31  # 8 GiB of fp32 if a client believed it
BIG_BYTES = 16 << 20  # what "allocates nothing big" means below


class FakeServer:
    """Accepts connections and runs ``script(channel)`` on each, after sending a CHALLENGE and reading the
    client's AUTH and its CHALLENGE (the fake does not check the AUTH: it only wants the worker)."""

    def __init__(self, script: Callable[[Channel, bytes], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.script = script
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            channel = Channel(sock, max_elements=1 << 40)
            try:
                channel.send_bytes(MsgType.CHALLENGE, b"n" * NONCE_SIZE, generation=1, rank=0, timeout=5)
                header = channel.recv_header(deadline_after(5))
                channel.recv_bytes(header, deadline_after(5))  # the worker's AUTH, taken at face value
                header = channel.recv_header(deadline_after(5))
                assert header.type is MsgType.CHALLENGE, header
                self.script(channel, channel.recv_bytes(header, deadline_after(5)))
            except (PeerClosedError, PSError, OSError):
                pass
            except BaseException as exc:  # noqa: BLE001 - surfaced by the test
                self.errors.append(exc)
            finally:
                channel.close()

    def close(self) -> None:
        try:  # wakes the blocked accept (a bare close does not, on Linux)
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.thread.join(5)
        assert not self.errors, self.errors


@pytest.fixture
def fake():
    servers: list[FakeServer] = []

    def make(script: Callable[[Channel, bytes], None]) -> FakeServer:
        servers.append(FakeServer(script))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def welcome(channel: Channel, **body) -> None:
    body = {"num_params": 6, "version": 0, "world_size": 1, **body}
    channel.send_json(MsgType.WELCOME, body, generation=1, rank=0, timeout=5)


def prove(secret: bytes) -> Callable[[Channel, bytes], None]:
    def script(channel: Channel, nonce: bytes) -> None:
        answer(channel, secret, nonce, generation=1, rank=0, deadline=None)
    return script


def connect_measured(client: PSClient):
    """Connect, returning (exception or info, peak bytes Python allocated meanwhile)."""
    tracemalloc.start()
    try:
        try:
            outcome = client.connect()
        except PSError as exc:
            outcome = exc
        return outcome, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        client.close()


def client_of(server: FakeServer, secret: bytes, **kwargs) -> PSClient:
    kwargs.setdefault("expected_params", 6)
    kwargs.setdefault("timeout_s", 2.0)
    return PSClient(*server.address, rank=0, secret=secret, **kwargs)


# -- a fake that does not hold the secret --------------------------------------------------------------
@pytest.mark.parametrize("proof", ["forged", "none", "welcome_instead"])
def test_a_listener_without_the_secret_is_refused_before_its_welcome(fake, proof) -> None:
    def script(channel: Channel, nonce: bytes) -> None:
        if proof == "forged":  # the best it can do: a MAC under some other key
            channel.send_bytes(MsgType.AUTH, auth_mac(new_secret(), nonce, 0, 1), generation=1, rank=0, timeout=5)
        if proof != "none":
            welcome(channel, num_params=HUGE)
        channel.sock.settimeout(5)
        channel.sock.recv(1)  # hold the connection until the client gives up

    server = fake(script)
    outcome, peak = connect_measured(client_of(server, new_secret(), expected_params=None, timeout_s=0.5))
    assert isinstance(outcome, (AuthenticationError, PSError)), outcome
    if proof == "forged":
        assert "failed to prove it holds this job's secret" in str(outcome)
    elif proof == "welcome_instead":
        assert "expected AUTH, got WELCOME" in str(outcome)
    else:
        assert "timed out" in str(outcome)
    assert peak < BIG_BYTES


# -- a fake that holds the secret and lies ---------------------------------------------------------------
def test_a_server_announcing_more_parameters_than_the_model_has_is_refused(fake) -> None:
    secret = new_secret()

    def script(channel: Channel, nonce: bytes) -> None:
        prove(secret)(channel, nonce)
        welcome(channel, num_params=HUGE)

    outcome, peak = connect_measured(client_of(fake(script), secret))
    assert isinstance(outcome, ProtocolError), outcome
    assert f"announced {HUGE} parameters but this worker's model has 6" in str(outcome)
    assert peak < BIG_BYTES


def test_a_server_announcing_other_buffer_words_is_refused(fake) -> None:
    secret = new_secret()

    def script(channel: Channel, nonce: bytes) -> None:
        prove(secret)(channel, nonce)
        welcome(channel, buffer_words=1 << 24)

    outcome, _ = connect_measured(client_of(fake(script), secret, expected_buffer_words=3))
    assert isinstance(outcome, ProtocolError) and "announced 16777216 buffer words" in str(outcome), outcome


@pytest.mark.parametrize("shards, match", [
    ([(0, 4), (3, 6)], "do not tile"),  # overlapping
    ([(0, 2), (4, 6)], "do not tile"),  # a gap
    ([(0, 4)], "do not tile"),  # not covering
    ([(i, i + 1) for i in range(65)], "shards, more than"),
])
def test_shard_ranges_must_tile_the_model(fake, shards, match) -> None:
    secret = new_secret()
    n = shards[-1][1]

    def script(channel: Channel, nonce: bytes) -> None:
        prove(secret)(channel, nonce)
        welcome(channel, num_params=n if n > 6 else 6,
                shards=[{"host": "127.0.0.1", "port": 1, "start": a, "end": b} for a, b in shards])

    outcome, _ = connect_measured(client_of(fake(script), secret, expected_params=n if n > 6 else 6))
    assert isinstance(outcome, ProtocolError) and match in str(outcome), outcome


def test_a_redirect_to_a_listener_without_the_secret_is_refused(fake) -> None:
    """Shard 0 is genuine (it holds the secret) but names shard 1 at an address a squatter holds."""
    secret = new_secret()
    squatter = fake(lambda channel, nonce: channel.send_bytes(
        MsgType.AUTH, auth_mac(new_secret(), nonce, 0, 1), generation=1, rank=0, timeout=5))

    def script(channel: Channel, nonce: bytes) -> None:
        prove(secret)(channel, nonce)
        host, port = squatter.address
        welcome(channel, shards=[{"host": "127.0.0.1", "port": 1, "start": 0, "end": 3},
                                 {"host": host, "port": port, "start": 3, "end": 6}])

    outcome, _ = connect_measured(client_of(fake(script), secret))
    assert isinstance(outcome, AuthenticationError), outcome
    assert f"the parameter server at {squatter.address[0]}:{squatter.address[1]} failed to prove" in str(outcome)


@pytest.mark.parametrize("frame", ["params_too_many", "params_wrong_length", "buffers_wrong_count"])
def test_frames_larger_than_announced_are_refused_before_their_payload(fake, frame) -> None:
    secret = new_secret()
    done = threading.Event()

    def script(channel: Channel, nonce: bytes) -> None:
        prove(secret)(channel, nonce)
        welcome(channel, buffer_words=2)
        channel.max_elements = 6
        request = channel.recv_header(deadline_after(5))
        if frame == "params_too_many":
            header = Header(MsgType.PARAMS, 1, 0, 0, DType.FLOAT32, HUGE, HUGE * 4)
        elif frame == "params_wrong_length":
            header = Header(MsgType.PARAMS, 1, 0, 0, DType.FLOAT32, 6, 1 << 40)
        else:
            assert request.type is MsgType.PULL_BUFFERS
            header = Header(MsgType.BUFFERS, 1, 0, 0, DType.FLOAT32, 1 << 20, 4 << 20)
        channel.sock.sendall(header.pack())  # no payload: the client must not wait for it
        done.wait(5)

    client = client_of(fake(script), secret, expected_buffer_words=2)
    client.connect()
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as raised:
            client.pull_buffers() if frame == "buffers_wrong_count" else client.pull(0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        done.set()
        client.close()
    assert "elements" in str(raised.value) or "words" in str(raised.value) or "length" in str(raised.value)
    assert peak < BIG_BYTES


def test_the_real_server_still_proves_itself(make_server, make_client) -> None:
    server = make_server(world_size=1)
    client = make_client(server, 0, expected_params=6)
    assert client.connect().num_params == 6
    version, params = client.pull(0)
    assert version == 0 and torch.equal(params, torch.arange(6, dtype=torch.float32))
    client.finish()


def test_the_real_server_of_another_model_is_refused(make_server, make_client) -> None:
    server = make_server(world_size=1)
    with pytest.raises(AuthenticationError, match="announced 6 parameters but this worker's model has 7"):
        make_client(server, 0, expected_params=7).connect()


def test_a_handshake_dropped_without_a_refusal_is_tried_again(fake) -> None:
    """What an eviction under a flood looks like to an honest worker: the listener hangs up mid-handshake
    without an ERROR. The worker opens the connection again within its connect deadline."""
    secret = new_secret()
    seen: list[int] = []

    def script(channel: Channel, nonce: bytes) -> None:
        seen.append(1)
        if len(seen) == 1:
            return  # hang up: evicted
        prove(secret)(channel, nonce)
        welcome(channel)

    client = client_of(fake(script), secret)
    try:
        assert client.connect().num_params == 6 and len(seen) == 2
    finally:
        client.close()


def test_a_refusal_is_final_at_once(fake) -> None:
    seen: list[int] = []

    def script(channel: Channel, nonce: bytes) -> None:
        seen.append(1)
        channel.send_json(MsgType.ERROR, {"error": "rank 0 already finished", "kind": "error"},
                          generation=1, rank=0, timeout=5)

    server = fake(script)
    outcome, _ = connect_measured(client_of(server, new_secret()))
    assert isinstance(outcome, AuthenticationError) and "parameter server refused rank 0: rank 0 already " \
        "finished" in str(outcome), outcome
    assert len(seen) == 1  # not tried again
