"""The authenticated stage-to-stage link: handshake both ways, validated frames, deadlines that name their key."""
import secrets
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipeline.errors import AuthenticationError, ProtocolError, PSError, PSTimeoutError
from pipeline.parallel import link as link_mod
from pipeline.parallel.link import (
    LINK_HEADER,
    LINK_MAGIC,
    LINK_VERSION,
    LinkFrame,
    StageListener,
    connect_link,
    decode_link_header,
)
from pipeline.ps.transport.protocol import Header, MsgType  # a parameter-server frame, sent where it does not belong
from pipeline.wire.deadline import CONNECT_KEY, LINK_KEY, Timeout
from pipeline.wire.frames import HEADER_SIZE, NONCE_SIZE, Channel, DType, PeerClosedError

SECRET = b"job-secret"
GEN = 3


def linked_pair(*, timeout_s=10.0, max_elements=1 << 20):
    """(upstream link held by stage 0 / rank 0, downstream link held by stage 1 / rank 1)."""
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, expect_rank=0, max_elements=max_elements,
                       timeout_s=timeout_s) as listener, ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept)
        host, port = listener.address
        up = connect_link(host, port, SECRET, GEN, stage=0, rank=0, expect_rank=1, max_elements=max_elements,
                          timeout_s=timeout_s)
        return up, accepted.result(timeout=30)


def test_activations_forward_and_gradients_back_over_one_connection():
    up, down = linked_pair()
    with up, down:
        act = torch.randn(5, 7)
        sent_before = up.bytes_sent
        up.send_activation(12, 3, act)
        assert up.bytes_sent - sent_before == HEADER_SIZE + act.numel() * 4
        got = down.recv_activation(12, 3, rows=5)
        assert torch.equal(got, act) and got.dtype == torch.float32
        grad = torch.randn(5, 7)
        down.send_grad(12, 3, grad)
        assert torch.equal(up.recv_grad(12, 3, rows=5, cols=7), grad)
        # Non-contiguous tensors are sent as their values.
        up.send_activation(13, 0, act.t())
        assert torch.equal(down.recv_activation(13, 0), act.t())
        assert (up.peer_stage, up.peer_rank, down.peer_stage, down.peer_rank) == (1, 1, 0, 0)


def test_wrong_secret_is_refused_and_the_listener_keeps_waiting():
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, timeout_s=10) as listener, \
            ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept)
        host, port = listener.address
        with pytest.raises(AuthenticationError, match="wrong secret"):
            connect_link(host, port, b"not-the-secret", GEN, stage=0, rank=0, timeout_s=5)
        with connect_link(host, port, SECRET, GEN, stage=0, rank=0, timeout_s=5) as up, \
                accepted.result(timeout=30) as down:
            up.send_activation(0, 0, torch.ones(1, 1))
            assert down.recv_activation(0, 0).item() == 1.0


def test_wrong_generation_is_refused():
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, timeout_s=2) as listener, \
            ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept)
        host, port = listener.address
        with pytest.raises(AuthenticationError, match=f"generation {GEN - 1} but stage 1 is at generation {GEN}"):
            connect_link(host, port, SECRET, GEN - 1, stage=0, rank=0, timeout_s=5)
        with pytest.raises(PSTimeoutError, match="waiting for stage 0 to connect.*ps.timeout_s"):
            accepted.result(timeout=30)


def test_unexpected_rank_is_refused():
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, expect_rank=0, timeout_s=2) as listener, \
            ThreadPoolExecutor(1) as pool:
        pool.submit(listener.accept)
        host, port = listener.address
        with pytest.raises(AuthenticationError, match="rank 5 is not stage 0"):
            connect_link(host, port, SECRET, GEN, stage=0, rank=5, timeout_s=5)


def test_a_listener_without_the_secret_gets_no_activations():
    """The connector checks the listener's proof too: a fake listener cannot answer its nonce."""
    server = socket.create_server(("127.0.0.1", 0))

    def impostor():
        sock, _ = server.accept()
        channel = Channel(sock)
        channel.send_bytes(MsgType.CHALLENGE, secrets.token_bytes(NONCE_SIZE), generation=GEN, rank=1, timeout=5)
        for _ in range(2):  # the connector's AUTH and CHALLENGE
            channel.recv_bytes(channel.recv_header(None), None)
        channel.send_bytes(MsgType.AUTH, bytes(32), generation=GEN, rank=1, timeout=5)
        with pytest.raises(PeerClosedError):
            channel.recv_header(None)  # the connector hangs up

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(AuthenticationError, match="failed to prove it holds this job's secret"):
            connect_link("127.0.0.1", server.getsockname()[1], SECRET, GEN, stage=0, rank=0, timeout_s=5)
    finally:
        thread.join(10)
        server.close()


def test_a_frame_of_another_step_micro_batch_or_shape_is_refused():
    up, down = linked_pair()
    with up, down:
        up.send_activation(11, 3, torch.zeros(2, 2))
        with pytest.raises(ProtocolError, match=r"expected activations for step 12 micro-batch 3 from stage 0 "
                                                r"\(rank 0\) but received activations for step 11 micro-batch 3"):
            down.recv_activation(12, 3)
        assert down.closed  # the stream may be out of sync: the link is done
    up, down = linked_pair()
    with up, down:
        up.send_activation(12, 2, torch.zeros(2, 2))
        with pytest.raises(ProtocolError, match="micro-batch 2; the stages are out of step"):
            down.recv_activation(12, 3)
    up, down = linked_pair()
    with up, down:
        down.send_grad(12, 3, torch.zeros(2, 2))
        with pytest.raises(ProtocolError, match=r"activation gradients for step 12 micro-batch 3 from stage 1 "
                                                r"\(rank 1\) have shape \(2, 2\), expected \(2, 3\)"):
            up.recv_grad(12, 3, rows=2, cols=3)


def test_a_receive_deadline_names_what_was_awaited_and_the_knob():
    up, down = linked_pair(timeout_s=0.5)
    with up, down:
        with pytest.raises(PSTimeoutError) as info:
            down.recv_activation(12, 3)
    message = str(info.value)
    assert "activations for step 12 micro-batch 3 from stage 0 (rank 0)" in message
    assert "ps.timeout_s" in message and "0.5s" in message


def test_a_closed_peer_is_reported_not_waited_for():
    up, down = linked_pair()
    up.close()
    with down, pytest.raises(PSError, match=r"stage 0 \(rank 0\) closed the link while stage 1 awaited "
                                             "activations for step 1 micro-batch 0"):
        down.recv_activation(1, 0)


def test_a_hostile_header_is_refused_before_any_allocation(monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("payload buffer allocated for a refused frame")

    monkeypatch.setattr(link_mod._LinkChannel, "recv_link_payload", no_allocation)
    up, down = linked_pair(max_elements=1000)
    with up, down:
        huge = 2**32 - 1
        raw = LINK_HEADER.pack(LINK_MAGIC, LINK_VERSION, int(LinkFrame.ACTIVATION), int(DType.FLOAT32), GEN, 0,
                               12, 3, huge, huge, 4 * huge * huge % 2**64)
        up._channel.sock.sendall(raw)
        with pytest.raises(ProtocolError, match=f"shape \\({huge}, {huge}\\) = {huge * huge} elements, more "
                                                "than the 1000 this link accepts"):
            down.recv_activation(12, 3)


def test_sending_more_than_the_cap_is_refused_locally():
    up, down = linked_pair(max_elements=10)
    with up, down, pytest.raises(PSError, match="exceed the 10 elements"):
        up.send_activation(0, 0, torch.zeros(4, 4))


@pytest.mark.parametrize("patch, match", [
    (dict(magic=b"SHPS"), "bad magic b'SHPS' on a stage link"),
    (dict(version=9), "stage link version 9 is not supported"),
    (dict(type_code=7), "unknown stage link frame type 7"),
    (dict(dtype=int(DType.FLOAT16)), "float32 only"),
    (dict(rows=0), r"empty shape \(0, 3\)"),
    (dict(length=5), r"payload length 5 != 2 \* 3 \* 4"),
])
def test_decode_refuses_malformed_headers(patch, match):
    fields = dict(magic=LINK_MAGIC, version=LINK_VERSION, type_code=1, dtype=int(DType.FLOAT32), generation=GEN,
                  rank=0, step=1, micro=0, rows=2, cols=3, length=24)
    fields.update(patch)
    with pytest.raises(ProtocolError, match=match):
        decode_link_header(LINK_HEADER.pack(*fields.values()), max_elements=100)


def test_a_ps_frame_on_a_link_fails_on_the_magic():
    up, down = linked_pair()
    with up, down:
        up._channel.send(Header(MsgType.PUSH, GEN, 0, 12, DType.FLOAT32, 1, 4), b"\0\0\0\0", timeout=5)
        with pytest.raises(ProtocolError, match="bad magic"):
            down.recv_activation(12, 0)


def test_each_wait_names_its_own_key():
    """Link waits are timeouts.link_s, accepting and connecting timeouts.connect_s; Timeouts pass through."""
    up, down = linked_pair(timeout_s=Timeout(0.3, LINK_KEY))
    with up, down:
        with pytest.raises(PSTimeoutError, match=r"after 0.3s waiting for activations for step 1 micro-batch 0 "
                                                 r"from stage 0 \(rank 0\);.*; raise timeouts.link_s$"):
            down.recv_activation(1, 0)
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, timeout_s=Timeout(30, LINK_KEY),
                       connect_timeout=0.2) as listener:
        assert listener.timeout_s == 30
        with pytest.raises(PSTimeoutError, match=r"after 0.2s waiting for stage 0 to connect to stage 1's link.*"
                                                 r"raise timeouts.connect_s \(unset: it follows ps.timeout_s\)$"):
            listener.accept()
        with pytest.raises(PSTimeoutError, match=r"after 0.1s .*raise timeouts.connect_s$"):
            listener.accept(Timeout(0.1, CONNECT_KEY))


def test_a_silent_listener_times_out_the_connect_wait():
    server = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never sends its CHALLENGE
    try:
        with pytest.raises(PSTimeoutError, match=r"after 0.2s waiting for the link handshake of stage 0 \(rank 0\) "
                                                 r"with stage 1 at .*raise timeouts.connect_s \(unset"):
            connect_link("127.0.0.1", server.getsockname()[1], SECRET, GEN, stage=0, rank=0, timeout_s=30,
                         connect_timeout=0.2)
    finally:
        server.close()
