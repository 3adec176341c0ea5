"""Which address of this process the driver-hosted PS binds (``ps.host`` unset).

Classic session: ``spark.driver.host``, the address Spark itself gave the executors for this process.
Spark Connect: the PS binds in the *client* process, but ``spark.driver.host`` is the Connect server's
driver — another machine when the server is remote, where binding fails or (worse) names a host the
executors reach that is not ours. The client's own reachable address is then the one its traffic to the
Connect server leaves from (the route toward the cluster); a loopback address qualifies only when the
server's driver is on this machine too. Anything else fails at once, saying to set ``ps.host``.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Optional

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this machine (binding a socket to it succeeds)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def route_address(host: str, port: int = 15002) -> Optional[str]:
    """This machine's source address toward ``host`` (a UDP connect: no packet is sent), or None."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


def connect_client_host(server_driver_host: Optional[str], server_host: str) -> str:
    """The PS address for a Spark Connect client whose server is at ``server_host`` and whose server-side
    driver reports ``server_driver_host``; a ConfigError naming ``ps.host`` when none is reachable."""
    if server_driver_host and is_local_address(server_driver_host):
        return server_driver_host  # the server's driver runs on this machine: its address is ours
    local = route_address(server_host)
    if local is not None and not is_loopback(local):
        log.info("spark connect: the server's driver host %s is not an address of this client; the parameter "
                 "server binds %s (this client's address toward %s); set ps.host to override",
                 server_driver_host, local, server_host)
        return local
    raise ConfigError(
        f"ps.host: the Spark Connect server's driver is at {server_driver_host!r} (spark.driver.host), not on this "
        f"client, and this client reaches the server at {server_host!r} only through "
        f"{local or 'no route'} — an address the executors cannot connect back to. The parameter server runs in "
        "this client process: set ps.host to an address of this machine that the executors can reach, or use "
        "ps.placement=task (the PS then runs inside rank 0's task)")


def is_connect_session(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def connect_server_host(spark, master: str) -> Optional[str]:
    """The Connect server's host for a Spark Connect session, None for a classic one."""
    if not is_connect_session(spark):
        return None
    client = getattr(spark, "client", None)
    host = getattr(client, "host", None)
    if host:
        return str(host)
    if master.startswith("sc://"):
        return master[len("sc://"):].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    return None


def ps_host(spark, cfg) -> str:
    if cfg.ps.host:
        return cfg.ps.host
    try:
        driver_host = spark.conf.get("spark.driver.host")
    except Exception:  # noqa: BLE001 - a session without the key
        driver_host = None
    server = connect_server_host(spark, cfg.spark.master)
    if server is not None:
        return connect_client_host(driver_host, server)
    return driver_host or socket.gethostbyname(socket.gethostname())


def local_master(spark) -> bool:
    """The workers run on this process's own host and cores: a classic session on a ``local[...]`` or
    ``local-cluster[...]`` master (a Spark Connect client may be elsewhere than its server's executors)."""
    if is_connect_session(spark):
        return False
    try:  # the conf, not the SparkContext: launch code stays Connect-clean (test_connect)
        return str(spark.conf.get("spark.master")).startswith("local")
    except Exception:  # noqa: BLE001 - a session without the key: assume a cluster
        return False
