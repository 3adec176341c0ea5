"""The server side of worker connections: one authenticated connection, who is connected in this
generation, and where each shard listens.

Everything here is guarded by the owning shard's condition (``ShardCore.cond``): the roster is read by
the handshake, the consistency policies (to name ranks that never connected or finished early) and
the driver's views, always together with the shard's other state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.ps.transport.protocol import Channel


@dataclass(eq=False)
class RankConnection:
    """One authenticated worker connection, served by its own thread (the only writer of its socket)."""

    rank: int
    generation: int
    channel: Channel
    grad_buf: bytearray  # receive buffer of this rank's pushes, reused for every push
    superseded: bool = False  # cut by new_generation(): its drop is not a worker failure
    pulled_version: int = 0  # version of the last PARAMS sent: the base of this rank's next gradient
    shm_offer: Any = None  # a shared-memory segment offered, not yet answered (pipeline.ps.transport.shm_offer)
    shm_reserved: int = 0  # bytes of the shard's ps.shared_memory_mb budget its rings hold
    params_in_page: bool = False  # the worker mapped the shared parameter page: PARAMS go as PARAMS_SHARED
    # Liveness as the driver's stall watch reads it (launch/ps_side/stall.py), written by this connection's
    # thread only, read without the lock (a float and a bool: a torn read cannot happen, a stale one is
    # a poll late): when its last request began or ended, and whether one is being served now (a rank
    # blocked in a synchronous step is waiting, not silent).
    heard_at: float = field(default_factory=time.monotonic)
    in_request: bool = False
    host: str = ""  # the address the rank connected from

    def silent_s(self, now: float) -> float:
        """Seconds since this rank was last heard, 0 while one of its requests is being served."""
        return 0.0 if self.in_request else max(0.0, now - self.heard_at)


@dataclass
class Roster:
    """Ranks of the current generation: connected now, finished, every rank that authenticated, and what
    each offered at the allreduce rendezvous (``pipeline.ps.server.meeting``)."""

    world_size: int
    connected: dict[int, RankConnection] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    registered: set[int] = field(default_factory=set)
    offers: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add_locked(self, conn: RankConnection) -> None:
        self.connected[conn.rank] = conn
        self.registered.add(conn.rank)

    def release_locked(self, conn: RankConnection) -> None:
        # A newer connection of the same rank (next generation) must survive the old one's cleanup.
        if self.connected.get(conn.rank) is conn:
            del self.connected[conn.rank]

    def finish_locked(self, conn: RankConnection) -> None:
        if self.connected.get(conn.rank) is conn:
            self.finished.add(conn.rank)
            self.release_locked(conn)

    def silences_locked(self) -> dict[int, tuple[float, str]]:
        """{rank: (seconds silent, host)} of the connected ranks."""
        now = time.monotonic()
        return {rank: (conn.silent_s(now), conn.host) for rank, conn in self.connected.items()}

    def never_connected_locked(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if r not in self.connected and r not in self.finished]

    def cut_locked(self) -> list[RankConnection]:
        """New generation: forget every rank; returns the connections to close (superseded)."""
        old = list(self.connected.values())
        for conn in old:
            conn.superseded = True
        self.connected.clear()
        self.finished.clear()
        self.registered.clear()
        self.offers.clear()
        return old


@dataclass(frozen=True)
class ShardAddress:
    """Where one shard listens and which slice ``[start, end)`` of the flat parameters it owns."""

    host: str
    port: int
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "start": self.start, "end": self.end}


def peer_host(channel: Channel) -> str:
    """The address a connection came from ("" when it is already gone, or not a socket)."""
    try:
        return str(channel.sock.getpeername()[0])
    except (OSError, AttributeError, IndexError):
        return ""
