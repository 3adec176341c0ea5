"""The process environment a collective backend reads while its group is created, and its release.

Gloo and NCCL open their own sockets for the ring/pairs, outside torch.distributed's store: gloo binds
the address its "default device" resolves (``GLOO_SOCKET_IFNAME``'s interface, else the host name's
address), NCCL its bootstrap listener on ``NCCL_SOCKET_IFNAME``'s interface. Both are pointed at the
interface that holds this task's own address, so no listener of a rank is on a wildcard or on another
network than the one Spark uses. Neither backend authenticates its peers (see the README's "Security"):
binding narrows who can reach them, it does not prove who connects.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import time
from contextlib import contextmanager
from typing import Iterator, Optional

log = logging.getLogger(__name__)

# torch's gloo work threads destroy a finished collective's work object themselves, which takes the GIL
# when the work captured Python thread-local state; the group's C++ destructor, run while the GIL is held
# when the group's (or a DDP reducer's) last reference goes, joins those threads. A work still being
# destroyed at that moment deadlocks both: seen once in CI, in a test that left its group right after its
# last backward. Sleeping (the GIL released) before leaving lets the threads finish first.
GLOO_SETTLE_S = 0.1

_SIOCGIFADDR = 0x8915
_VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def _ipv4_of(name: str) -> Optional[str]:
    """The IPv4 address of interface ``name`` (Linux ioctl), or None."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface holding ``address`` (an IP or a resolvable host name), or None."""
    try:
        ip = socket.getaddrinfo(address, None)[0][4][0]
    except OSError:
        return None
    try:
        import psutil  # optional: also knows IPv6 and non-Linux systems
    except ImportError:
        psutil = None
    if psutil is not None:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%", 1)[0] == ip for a in addrs):
                return name
        return None
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - no interface listing on this platform
        return None
    return next((name for name in names if _ipv4_of(name) == ip), None)


@contextmanager
def bound_interfaces(local_host: Optional[str], backend: str) -> Iterator[None]:
    """While the group is created: the backend's socket interface variable names the interface of
    ``local_host`` (unless the user set it), and NCCL reports a failing peer instead of hanging."""
    variable = _VARIABLE.get(backend)
    saved: dict[str, Optional[str]] = {}

    def put(key: str, value: str) -> None:
        saved[key] = os.environ.get(key)
        os.environ[key] = value

    interface = interface_of(local_host) if local_host else None
    if variable and interface and variable not in os.environ:
        put(variable, interface)
    elif variable and local_host and not interface and variable not in os.environ:
        log.warning("no network interface holds this task's address %s; %s sockets bind where %s resolves",
                    local_host, backend, socket.gethostname())
    if backend == "nccl" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ:
        # 2 = CleanUpOnly: the watchdog aborts a communicator whose collective failed or timed out and the
        # error is raised in the rank's thread (reported as its failure row), without killing the Python
        # worker (1) and instead of never aborting (0); torch's default for this variable varies by release.
        put("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    try:
        yield
    finally:
        # Spark reuses Python workers: leave the next task's environment as it was.
        for key, value in saved.items():
            if key == "TORCH_NCCL_ASYNC_ERROR_HANDLING":
                continue  # read again by the watchdog for the group's whole life
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def release(backend: str, failed: bool) -> None:
    """Leave the process group. After a failure under NCCL the communicator is aborted first: destroying
    it alone waits for outstanding collectives, which a dead peer never completes, so peers would only
    be released by the collective timeout (gloo's sockets close at once)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if backend == "gloo":
        time.sleep(GLOO_SETTLE_S)
    if failed and backend == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        try:
            if abort is not None:
                abort()
                return  # aborting also destroys the group
            dist.distributed_c10d._get_default_group().abort()
        except Exception:  # noqa: BLE001 - leaving must not mask the failure that got us here
            log.warning("could not abort the NCCL communicator", exc_info=True)
    dist.destroy_process_group()
