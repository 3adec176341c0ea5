"""Slots for connections that have not authenticated yet, apart from the slots of admitted peers.

Why: an unauthenticated socket costs a thread and may sit out the whole handshake deadline. Counted
against the one connection cap, a flood of idle or garbage sockets locked real ranks out. Here pending
connections have their own cap; at the cap the *oldest* pending one is evicted (its socket shut down,
which wakes its handshake thread) to make room for the newest, so a real peer — which answers at once —
gets through a flood that keeps its slots busy, and the flood cannot touch the admitted peers' slots.
A pending connection also has at most ``HANDSHAKE_S`` (``pipeline.wire.handshake``) to prove itself.

Used by the parameter-server listener (``pipeline.ps.transport.listener``) and the stage link listener
(``pipeline.parallel.link``).
"""
from __future__ import annotations

import socket
import threading
from collections import OrderedDict
from typing import Optional, Protocol

# Pending (unauthenticated) connections one listener keeps at a time. Far above any honest burst (every
# rank of a generation connecting at once is 2 x world_size at most for a few milliseconds).
PENDING_CAP = 64


class _HasSocket(Protocol):
    sock: socket.socket  # a Channel's: the TLS socket once wrapped, so an eviction wakes either


class PendingSlots:
    """The pending connections of one listener, oldest first. Thread-safe (its own lock)."""

    def __init__(self, cap: int = PENDING_CAP) -> None:
        if cap < 1:
            raise ValueError(f"the pending connection cap must be >= 1, got {cap}")
        self.cap = cap
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, _HasSocket] = OrderedDict()
        self._evicted: set[int] = set()
        self.evictions = 0

    def add(self, sock: _HasSocket) -> Optional[_HasSocket]:
        """Register a new pending connection (a Channel); at the cap, evict the oldest and return it (its
        socket already shut down)."""
        with self._lock:
            victim = None
            if len(self._pending) >= self.cap:
                key, victim = self._pending.popitem(last=False)
                self._evicted.add(key)
                self.evictions += 1
            self._pending[id(sock)] = sock
        if victim is not None:
            _shut(victim)
        return victim

    def settle(self, sock: _HasSocket) -> bool:
        """The socket's handshake ended (admitted or refused): free its slot. Returns whether it had
        been evicted meanwhile (then its handshake failure is the eviction, not the peer's fault)."""
        with self._lock:
            self._pending.pop(id(sock), None)
            if id(sock) in self._evicted:
                self._evicted.discard(id(sock))
                return True
            return False

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def shut_all(self) -> None:
        """Shut every pending socket down (the listener closes)."""
        with self._lock:
            socks = list(self._pending.values())
        for sock in socks:
            _shut(sock)


def _shut(item: _HasSocket) -> None:
    try:  # shutdown, not close: the handshake thread owns the socket and closes it
        item.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
