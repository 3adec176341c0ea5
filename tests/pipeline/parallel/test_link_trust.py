"""Stage links under a flood of idle and garbage connections (the real upstream stage still gets in),
and stage links over TLS (``ps.tls``) with a pinned fingerprint (issue 19, items 3 and 4)."""
from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipeline.errors import PSError
from pipeline.parallel.link import StageListener, connect_link
from pipeline.wire.pending import PENDING_CAP
from pipeline.wire.tls import new_job_cert

SECRET = b"job-secret-for-the-links"
GEN = 2


@pytest.fixture(scope="module")
def cert():
    return new_job_cert()


def _round_trip(up, down) -> None:
    x = torch.randn(4, 3)
    up.send_activation(0, 0, x)
    assert torch.equal(down.recv_activation(0, 0, rows=4, cols=3), x)
    down.send_grad(0, 0, 2 * x)
    assert torch.equal(up.recv_grad(0, 0, rows=4, cols=3), 2 * x)


def test_the_upstream_stage_links_up_during_a_flood() -> None:
    """More idle and garbage sockets than pending slots, opened before and while the real stage connects:
    today's one-at-a-time accept waited out each idle socket's handshake deadline."""
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, expect_rank=0, timeout_s=10.0) as listener, \
            ThreadPoolExecutor(1) as pool:
        host, port = listener.address
        socks: list[socket.socket] = []
        stop = threading.Event()

        def flood() -> None:
            end = time.monotonic() + 3.0
            for i in range(200):
                if stop.is_set() or time.monotonic() > end:
                    return
                try:
                    sock = socket.create_connection((host, port), timeout=1)
                    socks.append(sock)
                    if i % 2:
                        sock.sendall(os.urandom(64))
                except OSError:
                    pass
                time.sleep(0.005)

        flooder = threading.Thread(target=flood, daemon=True)
        accepted = pool.submit(listener.accept, 10.0)
        flooder.start()
        try:
            while len(socks) < PENDING_CAP + 16 and flooder.is_alive():
                time.sleep(0.01)
            up = connect_link(host, port, SECRET, GEN, stage=0, rank=0, expect_rank=1, timeout_s=10.0)
            # Today's one-at-a-time accept waited out each idle socket's handshake: this timed out.
            down = accepted.result(timeout=20)
        finally:
            stop.set()
            flooder.join(5)
            for sock in socks:
                sock.close()
        with up, down:
            _round_trip(up, down)


def test_links_over_tls(cert) -> None:
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, expect_rank=0, tls=cert) as listener, \
            ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept, 10.0)
        host, port = listener.address
        up = connect_link(host, port, SECRET, GEN, stage=0, rank=0, expect_rank=1, tls=cert.pinned())
        down = accepted.result(timeout=20)
        with up, down:
            _round_trip(up, down)
            big = torch.randn(300, 100)  # over 64 KiB: the TLS send path of large frames
            up.send_activation(1, 0, big)
            assert torch.equal(down.recv_activation(1, 0), big)


def test_a_link_with_a_wrong_fingerprint_is_refused(cert) -> None:
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, expect_rank=0, tls=cert) as listener, \
            ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept, 1.0)
        host, port = listener.address
        with pytest.raises(PSError, match="presented a TLS certificate with SHA-256 fingerprint"):
            connect_link(host, port, SECRET, GEN, stage=0, rank=0, tls=new_job_cert().pinned(), connect_timeout=2)
        with pytest.raises(PSError, match="timed out"):
            accepted.result(timeout=20)
