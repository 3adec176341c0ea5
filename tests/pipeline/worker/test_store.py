"""The allreduce rendezvous store: nobody without the job secret reads or writes a key, a real gloo group
meets through it, and nothing it opens listens on a wildcard address."""
import errno
import socket
import threading
import time
from datetime import timedelta

import pytest

from pipeline.errors import AuthenticationError
from pipeline.ps import new_secret
from pipeline.worker.distributed import Rendezvous, process_group
from pipeline.worker.store import StoreServer, make_auth_store
from pipeline.wire.deadline import CONNECT_KEY, Timeout


@pytest.fixture
def store_server():
    secret = new_secret()
    server = StoreServer("127.0.0.1", secret, 3)
    yield server, secret
    server.close()


def test_the_store_serves_the_c10d_operations_to_a_rank_holding_the_secret(store_server):
    server, secret = store_server
    store = make_auth_store(*server.address, secret, rank=0, generation=3, timeout_s=5)
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["a", "n"]) and not store.check(["missing"])
    assert store.compare_set("c", b"", b"x") == b"x" and store.compare_set("c", b"y", b"z") == b"x"
    store.append("a", b"2")
    assert store.multi_get(["a", "c"]) == [b"12", b"x"]
    store.multi_set(["p", "q"], [b"P", b"Q"])
    assert store.get("q") == b"Q" and store.num_keys() == 5
    assert store.delete_key("p") and not store.delete_key("p")
    with pytest.raises(RuntimeError, match="timeout"):
        store.wait(["never"], timedelta(milliseconds=50))
    later = threading.Timer(0.1, lambda: make_auth_store(*server.address, secret, rank=1, generation=3,
                                                         timeout_s=5).set("late", b"v"))
    later.start()
    assert store.get("late") == b"v"  # get blocks until another rank sets the key
    store.close()


def test_a_connection_without_the_secret_is_refused_before_it_can_read_or_write_a_key(store_server):
    server, secret = store_server
    ok = make_auth_store(*server.address, secret, rank=0, generation=3, timeout_s=5)
    ok.set("gloo/rank0", b"10.0.0.1:1234")
    with pytest.raises(AuthenticationError):
        make_auth_store(*server.address, b"not the job secret", rank=1, generation=3, timeout_s=5)
    with pytest.raises(AuthenticationError):  # a stale task of an earlier attempt
        make_auth_store(*server.address, secret, rank=1, generation=2, timeout_s=5)
    # A raw client speaking the store's request frames without the handshake gets nothing and changes nothing.
    from pipeline.worker.store import SET, _pack

    with socket.create_connection(server.address, timeout=5) as raw:
        raw.recv(48)  # the CHALLENGE
        raw.sendall(_pack(SET, [b"gloo/rank0", b"attacker:1"]))
        raw.settimeout(5)
        assert b"OK" not in raw.recv(4096)
    assert ok.get("gloo/rank0") == b"10.0.0.1:1234"
    # The server's thread counts the raw client's refusal after the client has seen it: wait for the count.
    deadline = time.monotonic() + 5
    while server.refused < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.refused >= 3
    ok.close()


def test_a_forged_store_is_refused_by_the_rank(store_server):
    """A squatter on the address that does not hold the secret cannot pose as the store (mutual handshake)."""
    _, secret = store_server
    forged = StoreServer("127.0.0.1", new_secret(), 3)
    try:
        with pytest.raises(AuthenticationError):
            make_auth_store(*forged.address, secret, rank=0, generation=3, timeout_s=5)
    finally:
        forged.close()


def test_a_process_group_without_the_secret_is_not_joined():
    with pytest.raises(ValueError, match="job secret"):
        with process_group(Rendezvous("127.0.0.1", 1, 5), 0, 1, "cpu"):
            pass


def test_a_gloo_group_meets_through_the_store_and_listens_on_no_wildcard(store_server):
    """Two ranks (threads of one process: each its own group is impossible, so a 1-rank group per
    rendezvous is checked for the listening sockets, and two ranks for the collective)."""
    import torch
    import torch.distributed as dist

    server, secret = store_server
    rendezvous = Rendezvous(*server.address, Timeout(30.0, CONNECT_KEY), secret=secret, generation=3,
                            local_host="127.0.0.1")
    with process_group(rendezvous, 0, 1, "cpu") as backend:
        assert backend == "gloo"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        from tests.pipeline.listeners import wildcard_listeners, listening

        import os

        assert listening([os.getpid()]), "expected the store's and gloo's listeners"
        assert wildcard_listeners([os.getpid()]) == []
    assert not dist.is_initialized()


def test_garbage_before_the_handshake_is_dropped_and_real_ranks_still_get_in(store_server):
    import os as _os

    server, secret = store_server
    for blob in (b"", b"\x00" * 48, _os.urandom(48), _os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(server.address, timeout=5) as raw:
            raw.recv(48)
            raw.sendall(blob)
            try:
                raw.shutdown(socket.SHUT_WR)
            except OSError as exc:  # the server may already have hung up on the garbage (ENOTCONN)
                assert exc.errno == errno.ENOTCONN, exc
            raw.settimeout(12)
            try:
                while raw.recv(4096):  # the server answers with at most a refusal, then hangs up
                    pass
            except ConnectionResetError:  # hung up with our garbage unread
                pass
    store = make_auth_store(*server.address, secret, rank=0, generation=3, timeout_s=5)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    store.close()


def test_store_frames_are_size_checked_before_anything_is_allocated():
    from hypothesis import given, settings, strategies as st

    from pipeline.worker.store import MAX_FRAME_BYTES, _FRAME, _recv

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=64))
    def fuzz(data):
        a, b = socket.socketpair()
        try:
            a.sendall(data)
            a.close()
            try:
                op, args = _recv(b)
            except (ConnectionError, ValueError):
                return
            assert sum(len(x) for x in args) <= len(data)
        finally:
            b.close()

    fuzz()
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_FRAME.pack(1, MAX_FRAME_BYTES + 1))
        with pytest.raises(ConnectionError, match="exceeds"):
            _recv(b)
