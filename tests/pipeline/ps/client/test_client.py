"""PSClient: deadlines become PSTimeoutError naming what was awaited, local validation keeps the
stream in sync, FAIL is best effort, and the PARAMS buffer is reused."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

from pipeline.errors import AuthenticationError, NonFiniteError, PSError, PSTimeoutError
from pipeline.ps import PSClient, new_secret
from pipeline.ps.client import ps_client as client_module
from pipeline.ps.transport.protocol import Channel, MsgType
from pipeline.wire.deadline import CONNECT_KEY, STEP_KEY, Timeout
from pipeline.wire.frames import MAX_JSON_BYTES, PeerClosedError
from pipeline.wire.handshake import answer


class SilentServer:
    """Accepts one connection, optionally completes the handshake, then reads but never answers:
    a stand-in for a hung driver."""

    def __init__(self, *, handshake: bool, secret: bytes = b"") -> None:
        self.secret = secret
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.handshake = handshake
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock, _ = self.listener.accept()
        channel = Channel(sock, max_elements=4)
        try:
            if self.handshake:
                channel.send_bytes(MsgType.CHALLENGE, b"n" * 32, generation=1, rank=0, timeout=5)
                header = channel.recv_header(None)
                channel.recv_bytes(header, None)  # accept any AUTH: this fake checks nothing
                header = channel.recv_header(None)  # but it holds the secret and proves it (mutual)
                answer(channel, self.secret, channel.recv_bytes(header, None), generation=1, rank=0,
                       deadline=None)
                channel.send_json(MsgType.WELCOME, {"num_params": 4, "version": 0, "world_size": 1},
                                  generation=1, rank=0, timeout=5)
            while True:  # swallow requests until the client gives up
                header = channel.recv_header(None)
                channel.skip(header, None)
        except (PeerClosedError, PSError, OSError):
            pass
        finally:
            channel.close()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


@pytest.fixture
def silent():
    servers: list[SilentServer] = []

    def make(*, handshake: bool, secret: bytes = b"") -> SilentServer:
        servers.append(SilentServer(handshake=handshake, secret=secret))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_handshake_deadline_names_what_and_the_key(silent) -> None:
    host, port = silent(handshake=False).address
    with pytest.raises(PSTimeoutError, match=r"rank 3 timed out after 0.2s waiting for the handshake.*ps\.timeout_s"):
        PSClient(host, port, rank=3, secret=new_secret(), timeout_s=0.2).connect()


def test_ack_deadline_raises_and_disconnects(silent) -> None:
    secret = new_secret()
    host, port = silent(handshake=True, secret=secret).address
    c = PSClient(host, port, rank=0, secret=secret, timeout_s=0.2)
    assert c.connect().num_params == 4
    with pytest.raises(PSTimeoutError, match=r"the ACK of the gradient for step 0.*ps\.timeout_s"):
        c.push(0, torch.zeros(4))
    with pytest.raises(PSError, match="not connected"):  # the stream was out of sync: dropped
        c.push(0, torch.zeros(4))


def test_unreachable_server_is_a_clear_error() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(PSError, match=f"cannot reach the parameter server at 127.0.0.1:{port}"):
        PSClient("127.0.0.1", port, rank=0, secret=new_secret(), timeout_s=0.5).connect()


def test_server_hanging_up_mid_handshake_is_an_authentication_error() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: listener.accept()[0].close(), daemon=True).start()
    with pytest.raises(AuthenticationError, match="closed the connection during the handshake"):
        PSClient(*listener.getsockname(), rank=0, secret=new_secret(), timeout_s=1).connect()
    listener.close()


def test_local_validation_does_not_break_the_connection(make_server, make_client) -> None:
    server = make_server(world_size=1)
    c = make_client(server, 0)
    info = c.connect()
    assert c.connect() is info and c.info is info  # idempotent
    assert (info.num_params, info.version, info.world_size) == (6, 0, 1)
    with pytest.raises(PSError, match="exceeds"):
        c.report({"blob": "x" * MAX_JSON_BYTES})
    with pytest.raises(PSError, match="pushed 5 gradient values for step 0"):
        c.push(0, torch.zeros(5))
    c.push(0, torch.ones(2, 3, dtype=torch.float64).t())  # converted: any shape, dtype, layout
    assert c.pull(1)[0] == 1
    c.finish()
    with pytest.raises(PSError, match="not connected"):
        c.pull()


def test_pull_reuses_one_receive_buffer(make_server, make_client) -> None:
    server = make_server(world_size=1)
    with make_client(server, 0) as c:
        version, first = c.pull(0)
        before = first.clone()
        c.push(0, torch.ones(6))
        version, second = c.pull(1)
        assert version == 1 and second is first  # same tensor, refilled in place
        assert torch.equal(second, before - 1.0)
        c.finish()


def test_exception_inside_the_block_is_reported_as_a_failure(make_server, make_client) -> None:
    server = make_server(world_size=2)
    with pytest.raises(RuntimeError):
        with make_client(server, 1):
            raise RuntimeError("loader crashed on shard 7")
    assert "RuntimeError: loader crashed on shard 7" in server.failures[1].error


def test_fail_connects_first_and_never_raises(make_server, make_client) -> None:
    server = make_server(world_size=2)
    make_client(server, 1).fail("could not open shard", log_tail="Traceback ...")
    assert server.failures[1].error == "could not open shard"
    assert server.failures[1].log_tail == "Traceback ..."
    c0 = make_client(server, 0)
    c0.connect()
    server.close()
    c0.fail("too late")  # server gone: logged, not raised


def test_connect_and_step_waits_name_their_own_keys(silent) -> None:
    host, port = silent(handshake=False).address
    c = PSClient(host, port, rank=3, secret=new_secret(), timeout_s=Timeout(5, STEP_KEY),
                 connect_timeout=Timeout(0.2, CONNECT_KEY))
    with pytest.raises(PSTimeoutError, match=r"^rank 3 timed out after 0.2s waiting for the handshake with the "
                                             r"parameter server at .*; raise timeouts.connect_s$"):
        c.connect()
    secret = new_secret()
    host, port = silent(handshake=True, secret=secret).address
    c = PSClient(host, port, rank=0, secret=secret, timeout_s=Timeout(0.2, STEP_KEY), connect_timeout=5)
    assert c.connect().num_params == 4 and c.timeout_s == 0.2
    with pytest.raises(PSTimeoutError, match=r"after 0.7s waiting for the ACK of the gradient for step 0 from the "
                                             r"parameter server at .*; raise timeouts.step_s$"):
        c.push(0, torch.zeros(4))


def test_a_float_timeout_follows_ps_timeout_s(silent) -> None:
    host, port = silent(handshake=False).address
    c = PSClient(host, port, rank=1, secret=new_secret(), timeout_s=30, connect_timeout=0.2)
    assert (c.step_timeout, c.connect_timeout) == (Timeout(30.0, STEP_KEY, "ps.timeout_s"),
                                                   Timeout(0.2, CONNECT_KEY, "ps.timeout_s"))
    with pytest.raises(PSTimeoutError, match=r"after 0.2s .*raise timeouts.connect_s \(unset: it follows "
                                             r"ps.timeout_s\)$"):
        c.connect()
    with pytest.raises(PSError, match=r"timeouts.step_s \(from ps.timeout_s\) must be > 0, got 0"):
        PSClient(host, port, rank=1, secret=new_secret(), timeout_s=0)


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("exc, retryable", [
    (NonFiniteError("loss is nan at step 3"), False),  # the same numbers would fail again
    (RuntimeError("loader crashed on shard 7"), True),
])
def test_report_failure_tells_the_server_whether_a_retry_could_succeed(make_server, make_client, shards, exc,
                                                                       retryable) -> None:
    server = make_server(world_size=2, shards=shards)
    c = make_client(server, 1)
    c.connect()
    c.report_failure(exc)  # returns once every shard acknowledged the FAIL
    assert server.failures[1].retryable is retryable
    assert server.root_failures[1].retryable is retryable
    assert server.failures[1].error == f"{type(exc).__name__}: {exc}"


def test_fail_sends_retryable_as_given(make_server, make_client) -> None:
    server = make_server(world_size=2)
    make_client(server, 0).fail("bad config", retryable=False)
    make_client(server, 1).fail("CUDA error: out of memory")
    assert (server.failures[0].retryable, server.failures[1].retryable) == (False, True)


def test_the_reply_wait_is_computed_once_not_per_request(make_server, make_client, monkeypatch) -> None:
    server = make_server(world_size=1)
    c = make_client(server, 0)
    # ps.timeout_s 1.5 plus the margin for the server's own ERROR: max(0.5, 25%).
    assert c._reply_wait == Timeout(2.0, STEP_KEY, "ps.timeout_s")

    def rebuilt(timeout: Timeout) -> Timeout:
        raise AssertionError("the PULL/ACK wait was rebuilt on the step path")

    monkeypatch.setattr(client_module, "_pull_wait", rebuilt)
    with c:
        assert c.pull(0)[0] == 0
        assert c.push(0, torch.ones(6)) == 0
        assert c.push_pull(1, torch.ones(6))[0] == 2
        c.finish()
