"""The link probe over real sockets on this machine: every host measured, the handshake enforced."""
import threading
import time

import pytest

from pipeline.errors import AuthenticationError
from pipeline.launch.strategy.link_probe import LinkProbeServer, probe_link
from pipeline.wire.deadline import Timeout

SECRET = b"k" * 32


def _client(address, secret, host, hosts, errors, rank=0):
    try:
        probe_link(*address, secret, rank=rank, own_host=host, hosts=hosts, timeout=Timeout(10, "timeouts.connect_s"))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        errors.append(exc)


def test_one_host_alone_measures_its_link():
    errors: list = []
    with LinkProbeServer("127.0.0.1", SECRET, transfer_bytes=4 << 20, timeout=Timeout(10, "timeouts.connect_s")) as server:
        _client(server.address, SECRET, "hostA", 1, errors)
        rates = server.wait(10)
    assert not errors and rates is not None, (errors, server.error)
    assert rates.hosts == 1 and rates.link_Bps > 1e7
    assert rates.driver_Bps == float("inf")  # one host: its own link is the one to count


def test_every_host_at_once_gives_the_driver_link_and_a_second_task_of_a_host_is_sent_home():
    errors: list = []
    with LinkProbeServer("127.0.0.1", SECRET, transfer_bytes=2 << 20, timeout=Timeout(10, "timeouts.connect_s")) as server:
        first = threading.Thread(target=_client, args=(server.address, SECRET, "hostA", 2, errors, 0))
        first.start()
        deadline = time.monotonic() + 10
        while server.hosts_seen < 1:
            assert time.monotonic() < deadline, server.error
            time.sleep(0.01)
        # another task of hostA (the first task of each host probes; a second one is told it is done at once)
        _client(server.address, SECRET, "hostA", 2, errors, 2)
        assert first.is_alive()  # hostA's prober waits for hostB: the hosts are measured together
        _client(server.address, SECRET, "hostB", 2, errors, 1)
        first.join(20)
        rates = server.wait(10)
    assert not errors, errors
    assert rates.hosts == 2 and rates.driver_Bps > 0 and rates.link_Bps > 0


def test_a_task_without_the_jobs_secret_is_refused_and_measures_nothing():
    errors: list = []
    with LinkProbeServer("127.0.0.1", SECRET, transfer_bytes=2 << 20, timeout=Timeout(1.5, "timeouts.connect_s")) as server:
        _client(server.address, b"x" * 32, "hostA", 1, errors)
        rates = server.wait(5)
    assert rates is None
    assert "no task reached the link probe within 1.5s (timeouts.connect_s)" in server.error
    assert len(errors) == 1 and isinstance(errors[0], AuthenticationError)
    with pytest.raises(AuthenticationError, match="wrong secret"):
        raise errors[0]
