"""The allreduce rendezvous store: a ``torch.distributed.Store`` served over an authenticated connection.

Why not torch's TCPStore: it accepts any connection (no secret: whoever reaches the port can read and write
the rendezvous keys, e.g. announce its own gloo address for a rank), and its server listens on every
interface. Here the group's first rank serves the keys from a :class:`StoreServer` bound to its own task
address (port 0: the OS picks, the listening socket itself is what the allGather offers, so no probe
socket and no bind race), and every rank — the server's own included — talks to it through a
:class:`AuthStore`, which opens with the wire's mutual HMAC handshake (``pipeline.wire.handshake``): a
connector without the job's secret for this generation is refused before it can read or write a key,
and a squatter on the address cannot pose as the store.

After the handshake the connection carries small request/response frames of this module's own (the
store is private to one process group): ``<op u8><length u32>`` then ``length`` bytes of
length-prefixed arguments. Sizes are capped before anything is allocated.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Optional

from pipeline.wire.deadline import deadline_after
from pipeline.wire.frames import Channel
from pipeline.wire.handshake import HANDSHAKE_S, Refusal, answer, client_handshake, send_refusal, server_handshake
from pipeline.wire.sockets import connect, listen, set_socket_options

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<BI")
_ARG = struct.Struct("<I")
# Gloo and c10d store addresses and counters: a few hundred bytes. A peer holding the secret is trusted,
# but a bug must not make the server allocate without bound.
MAX_FRAME_BYTES = 16 << 20
# The rank the server answers the mutual handshake as (it is nobody's rank: it is the store).
STORE_RANK = 0xFFFF_FFFF

SET, GET, ADD, COMPARE_SET, CHECK, WAIT, DELETE, NUM_KEYS, APPEND, MULTI_GET, MULTI_SET = range(1, 12)
OK, FAILED, TIMED_OUT = 0, 1, 2


def _pack(op: int, args: list[bytes]) -> bytes:
    body = b"".join(_ARG.pack(len(a)) + a for a in args)
    return _FRAME.pack(op, len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the rendezvous store connection closed")
        got += k
    return bytes(data)


def _recv(sock: socket.socket) -> tuple[int, list[bytes]]:
    op, length = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"rendezvous store frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    body, args, at = _recv_exact(sock, length), [], 0
    while at < length:
        if at + _ARG.size > length:
            raise ConnectionError("malformed rendezvous store frame")
        (n,) = _ARG.unpack_from(body, at)
        at += _ARG.size
        if at + n > length:
            raise ConnectionError("malformed rendezvous store frame")
        args.append(body[at:at + n])
        at += n
    return op, args


class StoreServer:
    """The keys of one process group, served on ``host`` (a specific address, never a wildcard) to
    connectors that prove they hold ``secret`` for ``generation``. A thread accepts; one thread per
    admitted connection serves it. :meth:`close` stops all of them."""

    def __init__(self, host: str, secret: bytes, generation: int, *, max_connections: int = 64) -> None:
        self._secret, self.generation = secret, generation
        self._sock = listen(host, 0, backlog=max(16, max_connections))
        self._host = host
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._max = max_connections
        self.refused = 0  # connections refused at the handshake (tests, logs)
        self._thread = threading.Thread(target=self._accept_loop, name="shardline-store", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._sock.getsockname()[1]

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            with self._cond:
                if len(self._conns) >= self._max:
                    sock.close()
                    continue
                self._conns.append(sock)
            # The handshake runs in the connection's own thread: a silent socket cannot stall the others.
            threading.Thread(target=self._serve, args=(sock, peer), name="shardline-store-conn",
                             daemon=True).start()

    def _admit(self, sock: socket.socket, peer) -> bool:
        channel = Channel(sock)
        try:
            set_socket_options(sock)
            claim = server_handshake(channel, self._secret, rank=STORE_RANK, generation=self.generation,
                                     timeout=HANDSHAKE_S, mutual=True)
            if claim.generation != self.generation:
                raise Refusal(f"rank {claim.rank} belongs to generation {claim.generation}, the rendezvous "
                              f"is at generation {self.generation}")
            answer(channel, self._secret, claim.nonce, generation=self.generation, rank=STORE_RANK,
                   deadline=deadline_after(HANDSHAKE_S))
        except Refusal as exc:
            self.refused += 1
            log.warning("the rendezvous store refused a connection from %s: %s", peer, exc.reason)
            send_refusal(channel, exc.reason, generation=self.generation, rank=STORE_RANK)
            return False
        except OSError as exc:
            self.refused += 1
            log.warning("the rendezvous store dropped a connection from %s: %s", peer, exc)
            return False
        log.debug("rendezvous store admitted rank %d from %s", claim.rank, peer)
        return True

    def _serve(self, sock: socket.socket, peer) -> None:
        try:
            if not self._admit(sock, peer):
                return
            sock.settimeout(None)
            while not self._closed.is_set():
                op, args = _recv(sock)
                status, out = self._handle(op, args)
                sock.sendall(_pack(status, out))
        except (OSError, ConnectionError, ValueError, struct.error):
            pass
        finally:
            with self._cond:
                if sock in self._conns:
                    self._conns.remove(sock)
            sock.close()

    def _wait_for(self, keys: list[str], timeout_ms: int) -> bool:
        """Under the lock: until every key exists (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout_ms / 1000.0 if timeout_ms > 0 else None
        while not all(k in self._data for k in keys):
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or self._closed.is_set():
                return False
            self._cond.wait(timeout=min(left, 1.0) if left is not None else 1.0)
        return True

    def _handle(self, op: int, args: list[bytes]) -> tuple[int, list[bytes]]:
        with self._cond:
            if op == SET:
                self._data[args[0].decode()] = args[1]
            elif op == GET:
                key = args[0].decode()
                if not self._wait_for([key], int(args[1])):
                    return TIMED_OUT, [f"key {key!r} not set within {int(args[1])} ms".encode()]
                return OK, [self._data[key]]
            elif op == ADD:
                key = args[0].decode()
                value = int(self._data.get(key, b"0")) + int(args[1])
                self._data[key] = str(value).encode()
                self._cond.notify_all()
                return OK, [str(value).encode()]
            elif op == COMPARE_SET:
                key, expected, desired = args[0].decode(), args[1], args[2]
                current = self._data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self._data[key] = desired
                    current = desired
                self._cond.notify_all()
                return OK, [current if current is not None else expected]
            elif op == CHECK:
                return OK, [b"1" if all(a.decode() in self._data for a in args) else b"0"]
            elif op == WAIT:
                keys = [a.decode() for a in args[1:]]
                if not self._wait_for(keys, int(args[0])):
                    return TIMED_OUT, [f"keys {keys} not set within {int(args[0])} ms".encode()]
            elif op == DELETE:
                found = self._data.pop(args[0].decode(), None) is not None
                return OK, [b"1" if found else b"0"]
            elif op == NUM_KEYS:
                return OK, [str(len(self._data)).encode()]
            elif op == APPEND:
                key = args[0].decode()
                self._data[key] = self._data.get(key, b"") + args[1]
            elif op == MULTI_GET:
                keys = [a.decode() for a in args[1:]]
                if not self._wait_for(keys, int(args[0])):
                    return TIMED_OUT, [f"keys {keys} not set within {int(args[0])} ms".encode()]
                return OK, [self._data[k] for k in keys]
            elif op == MULTI_SET:
                for key, value in zip(args[0::2], args[1::2]):
                    self._data[key.decode()] = value
            else:
                return FAILED, [f"unknown store operation {op}".encode()]
            self._cond.notify_all()
            return OK, []

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:  # pragma: no cover
            pass
        with self._cond:
            conns = list(self._conns)
            self._cond.notify_all()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _store_base():
    import torch.distributed as dist

    return dist.Store


def make_auth_store(host: str, port: int, secret: bytes, *, rank: int, generation: int, timeout_s: float):
    """An :class:`AuthStore` connected to the group's StoreServer (mutual handshake done)."""
    return _auth_store_class()(host, port, secret, rank=rank, generation=generation, timeout_s=timeout_s)


_CLASS = None


def _auth_store_class():
    global _CLASS
    if _CLASS is None:
        _CLASS = _define()
    return _CLASS


def _define():
    base = _store_base()

    class AuthStore(base):
        """A c10d Store whose every operation is a request to the group's StoreServer; thread-safe
        (one request at a time on the connection)."""

        def __init__(self, host: str, port: int, secret: bytes, *, rank: int, generation: int,
                     timeout_s: float) -> None:
            super().__init__()
            self._where = (host, port, secret, rank, generation)
            self._lock = threading.Lock()
            self._timeout = timedelta(seconds=timeout_s)
            sock = connect(host, port, timeout_s, who=f"rank {rank}", peer="the allreduce rendezvous store")
            channel = Channel(sock)
            try:
                client_handshake(channel, secret, rank=rank, generation=generation,
                                 deadline=deadline_after(min(timeout_s, HANDSHAKE_S)), mutual=True,
                                 peer="the allreduce rendezvous store")
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            self._sock = sock

        def _call(self, op: int, args: list[bytes]) -> list[bytes]:
            with self._lock:
                self._sock.sendall(_pack(op, args))
                status, out = _recv(self._sock)
            if status == TIMED_OUT:
                raise RuntimeError(f"rendezvous store: wait timeout: {out[0].decode()}")  # c10d reads timeouts so
            if status != OK:
                raise RuntimeError(f"rendezvous store: {out[0].decode() if out else 'failed'}")
            return out

        def _ms(self, timeout: Optional[timedelta] = None) -> bytes:
            t = self._timeout if timeout is None else timeout
            return str(max(1, int(t.total_seconds() * 1000))).encode()

        @staticmethod
        def _b(value) -> bytes:
            if isinstance(value, str):
                return value.encode()
            return bytes(value)

        def set(self, key, value) -> None:
            self._call(SET, [key.encode(), self._b(value)])

        def get(self, key) -> bytes:
            return self._call(GET, [key.encode(), self._ms()])[0]

        def add(self, key, value: int) -> int:
            return int(self._call(ADD, [key.encode(), str(int(value)).encode()])[0])

        def compare_set(self, key, expected, desired) -> bytes:
            return self._call(COMPARE_SET, [key.encode(), self._b(expected), self._b(desired)])[0]

        def check(self, keys) -> bool:
            return self._call(CHECK, [k.encode() for k in keys])[0] == b"1"

        def wait(self, keys, timeout: Optional[timedelta] = None) -> None:
            self._call(WAIT, [self._ms(timeout)] + [k.encode() for k in keys])

        def delete_key(self, key) -> bool:
            return self._call(DELETE, [key.encode()])[0] == b"1"

        def num_keys(self) -> int:
            return int(self._call(NUM_KEYS, [])[0])

        def append(self, key, value) -> None:
            self._call(APPEND, [key.encode(), self._b(value)])

        def multi_get(self, keys) -> list[bytes]:
            return self._call(MULTI_GET, [self._ms()] + [k.encode() for k in keys])

        def multi_set(self, keys, values) -> None:
            args: list[bytes] = []
            for key, value in zip(keys, values):
                args += [key.encode(), self._b(value)]
            self._call(MULTI_SET, args)

        def has_extended_api(self) -> bool:
            return True

        def set_timeout(self, timeout: timedelta) -> None:
            self._timeout = timeout

        @property
        def timeout(self) -> timedelta:
            return self._timeout

        def clone(self):
            host, port, secret, rank, generation = self._where
            return AuthStore(host, port, secret, rank=rank, generation=generation,
                             timeout_s=self._timeout.total_seconds())

        def close(self) -> None:
            try:
                self._sock.close()
            except OSError:  # pragma: no cover
                pass

    return AuthStore
