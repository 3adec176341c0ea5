"""The link-rate probe: how fast the first task of each host moves bytes to and from the server's host.

Driver side :class:`LinkProbeServer` (a context manager), task side :func:`probe_link`. Every connection
opens with the job's mutual HMAC handshake (pipeline.wire.handshake); after it, the server drives with
small JSON requests (length-prefixed, at most 64 KB, never unpickled) and the task answers each with one
handler from its dispatch table:

* ``{"op": "send", "bytes": n}``: the task sends n bytes; the server times their arrival;
* ``{"op": "recv", "bytes": n}``: the server sends n bytes; the task times them and answers ``{"seconds"}``;
* ``{"op": "done"}``: the probe is over.

A rate is timed from the moment the first ``SKIP_BYTES`` have arrived to the last byte, so a rate limiter's
burst allowance (tc tbf's 256 KB on the testbed) and TCP's slow start do not pass for link speed; the
bytes that came before that mark faster than the rate are the link's burst (a token-bucket shaper lets
that much through at once after an idle spell; slow start makes the estimate low, never high). The
first host is measured alone (its own link: what allreduce and host shards move over), then every host
at once (what the driver's link takes when every rank pushes to it together).
"""
from __future__ import annotations

import json
import logging
import math
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from pipeline.errors import PSError, ProtocolError
from pipeline.wire.deadline import Timeout, deadline_after, remaining

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024
SKIP_BYTES = 512 * 1024
CHUNK = 1 << 20
GENERATION = 0
NOT_LIMITING = 0.8  # every host at this share of its own rate at once: the driver's link is not what limits


@dataclass(frozen=True)
class LinkRates:
    link_Bps: float    # one host's link, alone (the slower direction)
    driver_Bps: float  # every host at once, summed (the slower direction); inf when that was every host's own rate
    hosts: int
    seconds: float     # how long the probe took
    burst_bytes: float = 0.0  # what one host's link lets through faster than its rate after an idle spell


def _send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise PSError("the link probe's peer closed the connection")
        got += k
    return bytes(buf)


def _recv_msg(sock: socket.socket) -> dict:
    (length,) = struct.unpack("<I", _recv_exact(sock, 4))
    if length > MAX_MESSAGE:
        raise ProtocolError(f"link probe message of {length} bytes exceeds the {MAX_MESSAGE} byte cap")
    obj = json.loads(_recv_exact(sock, length))
    if not isinstance(obj, dict):
        raise ProtocolError("link probe message is not a JSON object")
    return obj


def _drain_timed(sock: socket.socket, n: int) -> tuple[float, float]:
    """Receive n bytes: (seconds n bytes take at the rate timed from the SKIP_BYTES mark to the last byte,
    the bytes that came faster than that rate before the mark: a shaper's burst allowance)."""
    buf = bytearray(min(n, CHUNK))
    view, got, mark, first = memoryview(buf), 0, None, None
    while got < n:
        k = sock.recv_into(view[: min(len(buf), n - got)])
        if not k:
            raise PSError("the link probe's peer closed the connection mid-transfer")
        got += k
        first = first or time.perf_counter()
        if mark is None and got >= SKIP_BYTES:
            mark, marked = time.perf_counter(), got
    rate = max(n - marked, 1) / max(time.perf_counter() - mark, 1e-6)
    return n / rate, max(0.0, marked - rate * (mark - first))


def _send_zeros(sock: socket.socket, n: int) -> None:
    chunk = bytes(min(n, CHUNK))
    left = n
    while left:
        sock.sendall(chunk[: min(left, len(chunk))])
        left -= min(left, len(chunk))


# -- the task's side --------------------------------------------------------------------------------------
def _on_send(sock: socket.socket, request: dict) -> None:
    _send_zeros(sock, int(request["bytes"]))


def _on_recv(sock: socket.socket, request: dict) -> None:
    seconds, burst = _drain_timed(sock, int(request["bytes"]))
    _send_msg(sock, {"seconds": seconds, "burst": burst})


HANDLERS: dict[str, Callable[[socket.socket, dict], None]] = {"send": _on_send, "recv": _on_recv}


def probe_link(host: str, port: int, secret: bytes, *, rank: int, own_host: str, hosts: int,
               timeout: Timeout) -> None:
    """The first task of a host: connect, authenticate, answer the server's requests until it says done."""
    from pipeline.wire.frames import Channel
    from pipeline.wire.handshake import client_handshake
    from pipeline.wire.sockets import connect

    deadline = deadline_after(timeout.seconds)
    sock = connect(host, port, timeout, who=f"rank {rank}'s link probe", peer="the driver's link probe")
    try:
        client_handshake(Channel(sock), secret, rank=rank, generation=GENERATION, deadline=deadline, mutual=True,
                         peer="the driver's link probe")
        _send_msg(sock, {"host": own_host, "hosts": hosts})
        while True:
            sock.settimeout(remaining(deadline))
            request = _recv_msg(sock)
            if request.get("op") == "done":
                return
            handler = HANDLERS.get(request.get("op"))
            if handler is None:
                raise ProtocolError(f"link probe: unknown request {request.get('op')!r}")
            handler(sock, request)
    except TimeoutError:
        raise timeout.error(f"rank {rank}'s link probe to answer the driver at {host}:{port}") from None
    finally:
        sock.close()


# -- the driver's side ------------------------------------------------------------------------------------
class LinkProbeServer:
    """Listens on ``host`` (the parameter server's address) for the first task of each host; once every host
    announced (or ``timeout`` ran out, with those that did) it measures and :attr:`rates` holds the result."""

    def __init__(self, host: str, secret: bytes, *, transfer_bytes: int, timeout: Timeout) -> None:
        from pipeline.wire.sockets import listen

        self.secret, self.transfer_bytes, self.timeout = secret, transfer_bytes, timeout
        self._listener = listen(host, 0, backlog=64)
        self.address = (host, self._listener.getsockname()[1])
        self._probers: dict[str, socket.socket] = {}
        self._expected: Optional[int] = None
        self._lock = threading.Condition()
        self.rates: Optional[LinkRates] = None
        self.error: Optional[str] = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="shardline-link-probe", daemon=True)

    def __enter__(self) -> "LinkProbeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        for sock in self._probers.values():
            sock.close()

    @property
    def hosts_seen(self) -> int:
        """Hosts whose first task has announced itself so far."""
        with self._lock:
            return len(self._probers)

    def _admit(self, sock: socket.socket) -> None:
        from pipeline.wire.frames import Channel
        from pipeline.wire.handshake import HANDSHAKE_S, Refusal, answer, send_refusal, server_handshake

        channel = Channel(sock)
        try:
            claim = server_handshake(channel, self.secret, rank=0, generation=GENERATION, timeout=HANDSHAKE_S,
                                     mutual=True)
            if claim.generation != GENERATION:
                raise Refusal(f"generation {claim.generation} is not the link probe's")
            answer(channel, self.secret, claim.nonce, generation=GENERATION, rank=0, deadline=deadline_after(HANDSHAKE_S))
            sock.settimeout(HANDSHAKE_S)
            hello = _recv_msg(sock)
            host, hosts = str(hello["host"]), int(hello["hosts"])
        except Refusal as exc:
            log.warning("link probe: refused a connection: %s", exc)
            send_refusal(channel, str(exc), generation=GENERATION, rank=0)
            channel.linger_close()  # unread bytes would reset the connection before the refusal is read
            return
        except (OSError, PSError, KeyError, ValueError) as exc:
            log.warning("link probe: dropped a connection: %s", exc)
            sock.close()
            return
        with self._lock:
            if host in self._probers:
                _send_msg(sock, {"op": "done"})
                sock.close()
                return
            self._probers[host] = sock
            self._expected = hosts
            self._lock.notify_all()

    def _serve(self) -> None:
        deadline = deadline_after(self.timeout.seconds)
        self._listener.settimeout(0.2)
        while not self._closed:
            with self._lock:
                if self._expected is not None and len(self._probers) >= self._expected:
                    break
            if time.monotonic() >= deadline:
                break
            try:
                sock, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self._admit(sock)
        if self._closed:
            return
        try:
            if not self._probers:
                self.error = f"no task reached the link probe within {self.timeout.seconds:g}s ({self.timeout.key})"
                return
            self.rates = self._measure()
        except (OSError, PSError, ValueError, KeyError) as exc:
            self.error = f"link probe failed: {type(exc).__name__}: {exc}"
        finally:
            for sock in self._probers.values():
                try:
                    sock.settimeout(1.0)
                    _send_msg(sock, {"op": "done"})
                except OSError:
                    pass
            with self._lock:
                self._lock.notify_all()

    def wait(self, seconds: float) -> Optional[LinkRates]:
        self._thread.join(timeout=seconds)
        return self.rates

    def _up(self, sock: socket.socket) -> tuple[float, float]:
        _send_msg(sock, {"op": "send", "bytes": self.transfer_bytes})
        return _drain_timed(sock, self.transfer_bytes)

    def _down(self, sock: socket.socket) -> tuple[float, float]:
        _send_msg(sock, {"op": "recv", "bytes": self.transfer_bytes})
        _send_zeros(sock, self.transfer_bytes)
        answer = _recv_msg(sock)
        return float(answer["seconds"]), float(answer.get("burst", 0.0))

    def _measure(self) -> LinkRates:
        started = time.perf_counter()
        socks = [self._probers[h] for h in sorted(self._probers)]
        for sock in socks:
            sock.settimeout(self.timeout.seconds)
        n = self.transfer_bytes
        (up, up_burst), (down, down_burst) = self._up(socks[0]), self._down(socks[0])
        link = n / max(up, down)
        driver = math.inf  # one host: the driver's link is that host's link, already counted
        if len(socks) > 1:
            with ThreadPoolExecutor(len(socks)) as pool:
                up = max(t for t, _ in pool.map(self._up, socks))
                down = max(t for t, _ in pool.map(self._down, socks))
            together = len(socks) * n / max(up, down)
            # every host still at its own rate: the driver's link did not limit them, and how much more it
            # takes is unknown (inf: never the bottleneck in the model); else it is what they shared
            driver = math.inf if together >= NOT_LIMITING * len(socks) * link else together
        return LinkRates(link, driver, len(socks), time.perf_counter() - started, min(up_burst, down_burst))
