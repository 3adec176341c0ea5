"""Where the shard processes of ``ps.placement: hosts`` find the driver: one listener per barrier attempt,
bound to the driver's address, that admits only a process holding the attempt's secret and generation.

Each host's first barrier task starts a shard process (``host_shard``); the process opens its two control
links here (``control_link``) and says which host it is (index and count, as the tasks' own
``getTaskInfos`` order them), its address and pid. ``wait_for_hosts`` returns the K hosts once every
one of them is in, or raises a deadline error naming the hosts still missing and the knob.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pipeline.errors import PSError
from pipeline.ps.processes.control_link import CALLS, CHANNELS, Link, parse_link_rank
from pipeline.wire.deadline import Timeout, deadline_after

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import ServerCert

logger = logging.getLogger(__name__)

# Handshakes at once: a host has one process with two links; more is a flood, dropped unread.
MAX_PENDING = 64
# The hello is a small dict; the link's state-sized cap applies only once it is admitted.
HELLO_MAX_BYTES = 4096
MAX_HOSTS = 4096


@dataclass
class HostChild:
    """One host's shard process, as it introduced itself."""

    index: int
    hosts: int
    host: str  # the address it listens on (its executor's)
    pid: int
    calls: Optional[Link] = None
    events: Optional[Link] = None

    def describe(self) -> str:
        return f"host {self.index} ({self.host}, pid {self.pid})"

    def close(self) -> None:
        for link in (self.calls, self.events):
            if link is not None:
                link.close()


class ShardRegistry:
    """The driver's listener for one attempt's shard processes (a context manager)."""

    def __init__(self, host: str, secret: bytes, generation: int, *, max_bytes: int,
                 tls: Optional["ServerCert"] = None) -> None:
        from pipeline.wire.sockets import listen

        self._secret = secret
        self._generation = generation
        self._max_bytes = max_bytes
        self._tls = tls
        self._cond = threading.Condition()
        self._children: dict[int, HostChild] = {}
        self._problems: list[str] = []
        self._pending = threading.Semaphore(MAX_PENDING)
        self._closed = False
        self._handed_out = False  # wait_for_hosts returned the children: their links are the caller's now
        self._sock = listen(host, 0, backlog=MAX_PENDING)
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, daemon=True, name="ps-shard-registry")
        self._thread.start()

    def __enter__(self) -> "ShardRegistry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop admitting; links already handed out belong to their shards now."""
        with self._cond:
            self._closed = True
            for child in self._children.values():
                if not self._handed_out or child.calls is None or child.events is None:
                    child.close()  # never handed out: its process sees its links close and ends
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not on Linux
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                sock.close()
                continue
            threading.Thread(target=self._admit, args=(sock, peer), daemon=True, name="ps-shard-admit").start()

    def _admit(self, sock: socket.socket, peer: tuple) -> None:
        from pipeline.errors import ProtocolError
        from pipeline.wire.frames import Channel
        from pipeline.wire.handshake import HANDSHAKE_S, Refusal, answer, send_refusal, server_handshake
        from pipeline.wire.sockets import set_socket_options

        try:
            try:
                set_socket_options(sock)  # TCP_NODELAY (a call is a small write then a read) and keepalive
                if self._tls is not None:
                    from pipeline.wire.tls import wrap_server

                    sock = wrap_server(sock, self._tls, timeout=HANDSHAKE_S)
                channel = Channel(sock)
                claim = server_handshake(channel, self._secret, rank=0, generation=self._generation,
                                         timeout=HANDSHAKE_S, mutual=True)
                if claim.generation != self._generation:
                    send_refusal(channel, f"generation {claim.generation} is over; this attempt is generation "
                                          f"{self._generation}", generation=self._generation, rank=claim.rank)
                    raise Refusal(f"a shard process of generation {claim.generation}")
                answer(channel, self._secret, claim.nonce, generation=self._generation, rank=0,
                       deadline=deadline_after(HANDSHAKE_S))
                link = Link(sock, max_bytes=HELLO_MAX_BYTES, peer=f"{peer[0]}:{peer[1]}")
                link.set_io_timeout(HANDSHAKE_S)
                hello = link.recv()
                link.set_io_timeout(None)
                link.max_bytes = self._max_bytes
            except (Refusal, OSError, EOFError, PSError, ProtocolError) as exc:
                logger.warning("refused a shard-process connection from %s: %s", peer, exc)
                sock.close()
                return
            self._register(claim.rank, hello, link, peer)
        finally:
            self._pending.release()

    def _register(self, rank: int, hello: object, link: Link, peer: tuple) -> None:
        index, channel = parse_link_rank(rank)
        problem = None
        if not (isinstance(hello, dict) and {"index", "hosts", "host", "pid"} <= set(hello)
                and all(isinstance(hello[k], int) for k in ("index", "hosts", "pid"))
                and isinstance(hello["host"], str) and len(hello["host"]) <= 255):
            problem = f"a shard process at {peer[0]} sent no valid hello"
        elif hello["index"] != index or not 0 <= index < hello["hosts"] <= MAX_HOSTS:
            problem = f"a shard process at {peer[0]} claims host {index} of {hello['hosts']} (at most {MAX_HOSTS})"
        with self._cond:
            if self._closed:  # the attempt's wait is over: nobody would close this link
                link.close()
                return
            if problem is None:
                child = self._children.setdefault(index, HostChild(index, int(hello["hosts"]), str(hello["host"]),
                                                                   int(hello["pid"])))
                if child.pid != int(hello["pid"]) or (child.calls if channel == CALLS else child.events):
                    problem = f"two shard processes claim host {index} ({child.describe()} and pid {hello['pid']})"
                else:
                    setattr(child, "calls" if channel == CALLS else "events", link)
            if problem is not None:
                self._problems.append(problem)
                link.close()
            self._cond.notify_all()

    def wait_for_hosts(self, timeout: Timeout) -> list[HostChild]:
        """Every host's shard process with both links, in host order; PSTimeoutError naming the missing
        hosts, or PSError when they disagree on how many hosts there are."""
        deadline = deadline_after(timeout)
        with self._cond:
            while True:
                if self._problems:
                    raise PSError(f"ps.placement=hosts: {self._problems[0]}")
                counts = {c.hosts for c in self._children.values()}
                if len(counts) > 1:
                    raise PSError(f"ps.placement=hosts: the shard processes disagree on the number of hosts "
                                  f"({sorted(counts)})")
                ready = [c for c in self._children.values() if c.calls is not None and c.events is not None]
                if counts and len(ready) == next(iter(counts)):
                    self._handed_out = True
                    return sorted(ready, key=lambda c: c.index)
                expected = next(iter(counts)) if counts else None
                missing = (sorted(set(range(expected)) - {c.index for c in ready}) if expected is not None
                           else "every host")
                if self._closed:
                    raise PSError(f"the attempt ended before the parameter-server shard process of host(s) {missing} "
                                  "reached the driver")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise timeout.error(f"the parameter-server shard process of host(s) {missing} to reach the "
                                        f"driver at {self.address[0]}:{self.address[1]}",
                                        why="each host's first barrier task starts one")
                self._cond.wait(min(left, 0.5) if left is not None else 0.5)


__all__ = ["CHANNELS", "HostChild", "ShardRegistry"]
