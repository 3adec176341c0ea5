"""The control pipe between the driver and a shard process it started (``ps.server_processes``).

It reads only anonymous pipes (``os.pipe``) that the parent creates and that only the parent and its
own child hold. Nothing from the network reaches it. Even so its messages are data only, like every
other format of the project (``tests/pipeline/test_no_unsafe_deserialization.py``): ``codec``'s tagged
JSON plus raw buffers.
"""
from __future__ import annotations

from typing import Any

from pipeline.ps.processes.codec import LENGTH, decode, encode

class Pipe:
    """One end of a pipe carrying whole messages (``multiprocessing.connection``'s length-prefixed byte
    messages: a count, then the frames of ``encode``)."""

    def __init__(self, fd: int, *, readable: bool) -> None:
        from multiprocessing.connection import Connection

        self._conn = Connection(fd, readable=readable, writable=not readable)

    def send(self, obj: Any) -> None:
        frames = encode(obj)
        self._conn.send_bytes(LENGTH.pack(len(frames)))
        for frame in frames:
            self._conn.send_bytes(frame)

    def recv(self) -> Any:
        (count,) = LENGTH.unpack(self._conn.recv_bytes(LENGTH.size))
        return decode([self._conn.recv_bytes() for _ in range(count)])

    def poll(self, timeout: float) -> bool:
        return self._conn.poll(timeout)

    def close(self) -> None:
        self._conn.close()
