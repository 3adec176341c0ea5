"""The HMAC challenge-response of every connection: one-way (the parameter server) and mutual (stage
links), with the refusal reasons a listener logs and sends back."""
from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.errors import AuthenticationError, ProtocolError
from pipeline.wire import handshake as hs
from pipeline.wire.deadline import deadline_after
from pipeline.wire.frames import MAC_SIZE, NONCE_SIZE, Channel, Control, Header, PeerClosedError

SECRET = b"s" * 32
REPO = Path(__file__).resolve().parents[3]


def test_hmac_binds_nonce_rank_and_generation() -> None:
    secret, nonce = b"s" * 32, b"n" * 32
    mac = hs.auth_mac(secret, nonce, 3, 7)
    assert len(mac) == MAC_SIZE
    assert hs.verify_mac(secret, nonce, 3, 7, mac)
    assert not hs.verify_mac(b"x" * 32, nonce, 3, 7, mac)
    assert not hs.verify_mac(secret, b"m" * 32, 3, 7, mac)
    assert not hs.verify_mac(secret, nonce, 4, 7, mac)
    assert not hs.verify_mac(secret, nonce, 3, 8, mac)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    client, server = Channel(a), Channel(b)
    yield client, server
    client.close()
    server.close()


def serve(server: Channel, secret: bytes = SECRET, *, mutual: bool, timeout: float = 5.0, generation: int = 4):
    """The server side in a thread: its Claim or its Refusal."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(hs.server_handshake, server, secret, rank=9, generation=generation, timeout=timeout,
                         mutual=mutual)
    pool.shutdown(wait=False)
    return future


def test_one_way_the_client_proves_its_rank_and_generation(pair) -> None:
    client, server = pair
    claimed = serve(server, mutual=False)
    assert hs.client_handshake(client, SECRET, rank=3, generation=4, deadline=deadline_after(5)) is None
    assert claimed.result(5) == hs.Claim(3, 4, None)


def test_mutual_both_sides_prove_themselves(pair) -> None:
    client, server = pair
    claimed = serve(server, mutual=True)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("claim", hs.client_handshake(
        client, SECRET, rank=3, generation=4, deadline=deadline_after(5), mutual=True)))
    thread.start()
    claim = claimed.result(5)
    assert (claim.rank, claim.generation, len(claim.nonce)) == (3, 4, NONCE_SIZE)
    hs.answer(server, SECRET, claim.nonce, generation=4, rank=9, deadline=deadline_after(5))
    thread.join(5)
    assert result["claim"] == hs.Claim(9, 4)


def test_a_wrong_secret_is_refused_with_the_reason(pair) -> None:
    client, server = pair
    claimed = serve(server, mutual=False)
    hs.client_handshake(client, b"other", rank=5, generation=4, deadline=deadline_after(5))
    with pytest.raises(hs.Refusal, match="authentication failed for rank 5: wrong secret"):
        claimed.result(5)


def test_a_frame_other_than_auth_is_refused_before_its_payload(pair) -> None:
    client, server = pair
    claimed = serve(server, mutual=False)
    client.recv_bytes(client.recv_header(deadline_after(5)), deadline_after(5))
    client.send_bytes(Control.CHALLENGE, b"n" * 32, generation=4, rank=5, timeout=5)
    with pytest.raises(hs.Refusal, match="handshake failed: expected AUTH, got CHALLENGE"):
        claimed.result(5)


def test_a_silent_peer_is_refused_at_the_deadline(pair) -> None:
    _, server = pair
    with pytest.raises(hs.Refusal, match="no AUTH within 0.1s of connecting"):
        serve(server, mutual=False, timeout=0.1).result(5)


def test_mutual_a_listener_without_the_secret_is_not_believed(pair) -> None:
    client, server = pair
    claimed = serve(server, b"impostor", mutual=True)

    def impostor() -> None:
        claim = claimed.exception(5) or claimed.result(5)  # the impostor cannot verify the client either
        assert isinstance(claim, hs.Refusal)
        hs.answer(server, b"impostor", b"n" * 32, generation=4, rank=9, deadline=deadline_after(5))

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(AuthenticationError, match="the listener failed to prove it holds this job's secret "
                                                  "for generation 4"):
        hs.client_handshake(client, SECRET, rank=3, generation=4, deadline=deadline_after(5), mutual=True,
                            peer="the listener")
    thread.join(5)


def test_an_error_frame_is_a_refusal_that_says_when_it_came(pair) -> None:
    client, server = pair
    hs.send_refusal(server, "no room", generation=4, rank=9)
    with pytest.raises(hs.PeerRefused, match="^no room$") as early:
        hs.client_handshake(client, SECRET, rank=3, generation=4, deadline=deadline_after(5))
    assert not early.value.answered and early.value.reason == "no room"

    claimed = serve(server, mutual=True)
    thread = threading.Thread(target=lambda: claimed.result(5) and hs.send_refusal(
        server, "rank 3 is not stage 0", generation=4, rank=9))
    thread.start()
    with pytest.raises(hs.PeerRefused) as late:
        hs.client_handshake(client, SECRET, rank=3, generation=4, deadline=deadline_after(5), mutual=True)
    thread.join(5)
    assert late.value.answered and late.value.reason == "rank 3 is not stage 0"


def test_client_errors_are_left_to_the_caller(pair) -> None:
    client, server = pair
    with pytest.raises(TimeoutError):
        hs.client_handshake(client, SECRET, rank=3, generation=4, deadline=deadline_after(0.05))
    server.send(Header(Control.AUTH, 4, 9, length=MAC_SIZE), bytes(MAC_SIZE), timeout=1)
    with pytest.raises(ProtocolError, match="expected CHALLENGE, got AUTH"):
        hs.client_handshake(client, SECRET, rank=3, generation=4, deadline=deadline_after(5))
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(PeerClosedError):
        hs.client_handshake(Channel(a), SECRET, rank=3, generation=4, deadline=deadline_after(5))
    a.close()


def test_send_refusal_is_best_effort(pair) -> None:
    client, server = pair
    client.close()
    server.close()
    hs.send_refusal(server, "x" * 10, generation=1, rank=0)  # no raise


def test_the_wire_needs_nothing_of_pipeline_but_errors_and_no_torch_to_load() -> None:
    for path in (REPO / "pipeline" / "wire").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
                assert node.module == "pipeline.errors" or node.module.startswith("pipeline.wire"), (path, node.module)
    code = ("import sys, pipeline.wire, pipeline.wire.frames, pipeline.wire.handshake, pipeline.wire.sockets;"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pipeline.') "
            "and not m.startswith(('pipeline.wire', 'pipeline.errors'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
