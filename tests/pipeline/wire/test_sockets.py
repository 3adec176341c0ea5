"""Sockets: options on both ends, a listener on a specific address, connect errors that name the peer
and the key of the wait."""
import socket

import pytest

from pipeline.errors import PSError, PSTimeoutError
from pipeline.wire import sockets as s
from pipeline.wire.deadline import CONNECT_KEY, Timeout


def test_listen_and_connect_set_the_options() -> None:
    with s.listen("127.0.0.1", 0, backlog=4) as listener:
        host, port = listener.getsockname()[:2]
        assert host == "127.0.0.1" and port > 0
        sock = s.connect(host, port, 5.0, who="rank 0", peer="the parameter server")
        accepted, _ = listener.accept()
        with sock, accepted:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
            assert sock.gettimeout() == 5.0


def test_an_unreachable_peer_is_named() -> None:
    probe = s.listen("127.0.0.1", 0, backlog=1)
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(PSError, match=f"stage 0 \\(rank 0\\) cannot reach stage 1 at 127.0.0.1:{port}"):
        s.connect("127.0.0.1", port, 1.0, who="stage 0 (rank 0)", peer="stage 1")


def test_a_connect_timeout_names_its_key(monkeypatch) -> None:
    def hang(*args, **kwargs):
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", hang)
    with pytest.raises(PSTimeoutError) as info:
        s.connect("10.0.0.1", 9, Timeout.of(0.3, CONNECT_KEY), who="rank 2", peer="the parameter server",
                  advice="check that executors can reach the driver")
    assert str(info.value) == ("timed out after 0.3s waiting for rank 2 to connect to the parameter server at "
                               "10.0.0.1:9; check that executors can reach the driver; raise timeouts.connect_s "
                               "(unset: it follows ps.timeout_s)")


def test_family_follows_the_address() -> None:
    assert s.family_of("::1") == socket.AF_INET6 and s.family_of("10.1.2.3") == socket.AF_INET
