"""The LISTEN sockets of given processes: psutil when installed, else /proc/net/tcp{,6} matched to the
socket inodes in /proc/<pid>/fd (Linux)."""
from __future__ import annotations

import os
import socket
import struct

WILDCARDS = {"0.0.0.0", "::", ""}
_LISTEN = "0A"


def _proc_listeners() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket of the host."""
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            if family == socket.AF_INET:
                address = socket.inet_ntop(family, struct.pack("<I", int(host, 16)))
            else:  # four little-endian 32-bit words
                address = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found[int(fields[9])] = (address, int(port, 16))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # the process is gone
        pass
    return inodes


def listening(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes listen on."""
    try:
        import psutil
    except ImportError:
        psutil = None
    out = []
    if psutil is not None:
        for pid in pids:
            try:
                conns = psutil.Process(pid).net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out += [(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
        return out
    table = _proc_listeners()
    for pid in pids:
        out += [(pid, *table[i]) for i in _socket_inodes(pid) if i in table]
    return out


def wildcard_listeners(pids) -> list[tuple[int, str, int]]:
    return [entry for entry in listening(pids) if entry[1] in WILDCARDS]


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, recursively (Spark's JVM forks the Python daemon, which forks workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def python_processes(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if "python" in os.path.basename(exe):
            out.append(pid)
    return out
