"""Sockets every shardline connection uses: options, buffer sizes, connecting and listening on a
specific address (never a wildcard bind; port 0 asks the OS for a free one)."""
from __future__ import annotations

import socket
from typing import Union

from pipeline.errors import PSError
from pipeline.wire.deadline import Timeout

SOCKET_BUFFER_BYTES = 4 << 20


def set_buffer_sizes(sock: socket.socket, size: int = SOCKET_BUFFER_BYTES) -> None:
    """Kernel send/receive buffers that hold a whole multi-MB tensor frame, so a frame moves in a few
    large copies instead of many window-sized ones (the kernel caps this at net.core.[rw]mem_max)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            if sock.getsockopt(socket.SOL_SOCKET, opt) < size:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
        except OSError:  # pragma: no cover - platform without the option
            pass


def set_socket_options(sock: socket.socket) -> None:
    """TCP_NODELAY (small control frames must not wait for Nagle), large buffers and keepalive (so a
    vanished host is eventually noticed even when the other side is idle)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_buffer_sizes(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:  # pragma: no cover - platform without the option
                pass


def family_of(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal, else AF_INET."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listen(host: str, port: int = 0, *, backlog: int) -> socket.socket:
    """A listening socket on ``host:port`` exactly (port 0: OS-chosen), with the large buffers set on it
    so accepted sockets inherit them from the SYN on (window scaling is agreed there). Raises OSError."""
    listener = socket.create_server((host, port), family=family_of(host), backlog=backlog)
    set_buffer_sizes(listener)
    return listener


def connect(host: str, port: int, timeout: Union[Timeout, float], *, who: str, peer: str,
            advice: str = "") -> socket.socket:
    """A connected socket to ``peer`` at ``host:port`` with :func:`set_socket_options` applied.

    ``who`` names this side for the messages ("rank 3", "stage 0 (rank 0)"). Running out of
    ``timeout`` raises PSTimeoutError naming its key (and ``advice``, e.g. what to check); any other
    failure raises PSError "<who> cannot reach <peer> at host:port: <why>".
    """
    timeout = Timeout.of(timeout)
    try:
        sock = socket.create_connection((host, port), timeout=timeout.seconds)
    except TimeoutError:
        raise timeout.error(f"{who} to connect to {peer} at {host}:{port}", why=advice) from None
    except OSError as exc:
        raise PSError(f"{who} cannot reach {peer} at {host}:{port}: {exc}") from exc
    try:
        set_socket_options(sock)
    except OSError as exc:
        sock.close()
        raise PSError(f"{who} cannot reach {peer} at {host}:{port}: {exc}") from exc
    return sock
