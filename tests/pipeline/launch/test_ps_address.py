"""Where the driver-hosted PS binds under Spark Connect: the client's own reachable address, never the
server's spark.driver.host when that is another machine, else a ConfigError saying to set ps.host."""
import pytest

from pipeline.errors import ConfigError
from pipeline.launch.placement.ps_address import (connect_client_host, is_local_address, is_loopback,
                                                  local_master, route_address)
from pipeline.launch.plans import ps_settings

ELSEWHERE = "192.0.2.10"  # TEST-NET-1: never an address of this machine
SERVER_ELSEWHERE = "198.51.100.20"  # TEST-NET-2


def test_an_address_of_this_machine_is_local_and_another_is_not():
    assert is_local_address("127.0.0.1")
    assert not is_local_address(ELSEWHERE)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback(ELSEWHERE)


def test_a_server_driver_on_this_machine_keeps_its_address():
    assert connect_client_host("127.0.0.1", "127.0.0.1") == "127.0.0.1"


def test_a_remote_server_driver_gives_the_clients_own_address_toward_the_server():
    local = route_address(SERVER_ELSEWHERE)
    if local is None or is_loopback(local):
        pytest.skip("this machine has no route off loopback")
    chosen = connect_client_host(ELSEWHERE, SERVER_ELSEWHERE)
    assert chosen == local and chosen != ELSEWHERE and is_local_address(chosen)


def test_a_remote_server_driver_reached_only_over_loopback_fails_at_once_naming_ps_host():
    """E.g. an SSH tunnel to a remote Connect server: the executors cannot reach this client on 127.0.0.1."""
    with pytest.raises(ConfigError, match=r"ps.host: the Spark Connect server's driver is at '192.0.2.10' .*not "
                                          r"on this client.*set ps.host to an address of this machine"):
        connect_client_host(ELSEWHERE, "127.0.0.1")


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]"])
def test_ps_host_may_not_be_a_wildcard(wildcard):
    from pipeline.config import build

    with pytest.raises(ConfigError, match=r"ps.host: .*would listen on every interface"):
        build({"ps": {"host": wildcard}})


class _Session:  # a classic session's surface local_master reads (a real cluster cannot start here)
    def __init__(self, master=None):
        self.conf = self
        self._master = master

    def get(self, key):
        if self._master is None:
            raise KeyError(key)
        return {"spark.master": self._master}[key]


def test_workers_share_the_drivers_cores_only_under_a_local_master(spark):
    assert local_master(spark)  # the tests' local[2] session
    assert local_master(_Session("local-cluster[2,1,1024]"))
    assert not local_master(_Session("spark://10.0.0.5:7077")) and not local_master(_Session("yarn"))
    assert not local_master(_Session())


@pytest.mark.parametrize("key, local, threads", [(None, True, 1), (None, False, 0), (0, True, 0), (4, False, 4)])
def test_ps_server_threads_defaults_to_one_thread_where_the_workers_share_the_cores(key, local, threads):
    from pipeline.config import build

    cfg = build({"ps": {} if key is None else {"server_threads": key}})
    assert ps_settings(cfg, local_workers=local).server_threads == threads
