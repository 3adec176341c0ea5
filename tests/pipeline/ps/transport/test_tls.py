"""``ps.tls``: a real server and clients over TLS with a per-job self-signed certificate; a client pins
its fingerprint, and one that holds another fingerprint (a listener with another certificate) is refused."""
from __future__ import annotations

import socket

import pytest
import torch

from pipeline.errors import AuthenticationError, PSError
from pipeline.wire.tls import PinnedCert, new_job_cert


@pytest.fixture(scope="module")
def cert():
    return new_job_cert()


def test_training_steps_over_tls(make_server, make_client, cert) -> None:
    server = make_server(world_size=1, shards=2, tls=cert)
    with make_client(server, 0, tls=cert.pinned(), expected_params=6) as c:
        assert c.num_shards == 2
        for step in range(2):
            version, _ = c.pull(step)
            assert version == step
            c.push(step, torch.ones(6))
        version, params = c.pull(2)
        assert version == 2 and torch.equal(params, torch.arange(6, dtype=torch.float32) - 2)
        c.finish()
    # Every frame went through TLS: the server saw no plaintext client (nothing was rejected).
    assert server.stats["rejected_connections"] == 0


def test_a_wrong_fingerprint_is_refused_before_the_handshake(make_server, make_client, cert) -> None:
    server = make_server(world_size=1, tls=cert)
    other = new_job_cert().pinned()
    with pytest.raises(AuthenticationError, match=r"presented a TLS certificate with SHA-256 fingerprint "
                                                  rf"{cert.fingerprint[:16]}\.\.\., not this job's "
                                                  rf"{other.fingerprint[:16]}"):
        make_client(server, 0, tls=other).connect()
    # The same server still serves a client that pins the right one.
    with make_client(server, 0, tls=cert.pinned()) as c:
        assert c.pull(0)[0] == 0
        c.finish()


def test_a_plaintext_client_gets_nothing_from_a_tls_server(make_server, make_client, cert) -> None:
    server = make_server(world_size=1, tls=cert)
    with pytest.raises(PSError):
        make_client(server, 0, timeout_s=1.0).connect()
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(b"\0" * 48)  # no TLS hello: the server hangs up, it never sends a CHALLENGE in clear
        sock.settimeout(5)
        try:
            data = sock.recv(4096)
        except ConnectionResetError:
            data = b""
        assert b"SHPS" not in data


def test_a_tls_client_refuses_a_plaintext_listener(make_server, make_client) -> None:
    server = make_server(world_size=1)
    with pytest.raises(PSError):
        make_client(server, 0, tls=PinnedCert("0" * 64), timeout_s=1.0).connect()


def test_the_key_stays_out_of_repr(cert) -> None:
    assert b"PRIVATE" in cert.key_pem and "PRIVATE" not in repr(cert)


def test_large_frames_over_tls(make_server, make_client, cert) -> None:
    """Frames over 64 KiB go out with sendmsg on plain sockets; a TLS socket has none (its own path)."""
    n = 100_000
    server = make_server(torch.zeros(n), world_size=1, tls=cert)
    with make_client(server, 0, tls=cert.pinned(), expected_params=n) as c:
        c.push(0, torch.ones(n))
        version, params = c.pull(1)
        assert version == 1 and torch.equal(params, torch.full((n,), -1.0))
        c.finish()
