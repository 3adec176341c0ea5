"""The control pipe between the driver and a shard process it started (``ps.server_processes``).

This is the one module of ``pipeline.ps`` that deserializes Python objects, and it only reads from
anonymous pipes (``os.pipe``) that the parent creates and that only the parent and its own child hold.
It never touches a socket. Nothing from the network reaches it: workers speak the binary PS wire to the
child's listener, where no object is ever deserialized (``tests/pipeline/ps/test_source.py`` checks
both). Messages are typed by their senders (``shard_process.ShardInit``, ``(op, args)`` calls and
``(kind, ...)`` events).

Why plain ``pickle`` and not ``multiprocessing``'s: torch registers reducers there that share tensors
through file descriptors and an authkey server. Here a tensor travels as its bytes.
"""
from __future__ import annotations

import pickle
from typing import Any


class Pipe:
    """One end of a pipe carrying whole messages (length-prefixed, ``multiprocessing.connection``)."""

    def __init__(self, fd: int, *, readable: bool) -> None:
        from multiprocessing.connection import Connection

        self._conn = Connection(fd, readable=readable, writable=not readable)

    def send(self, obj: Any) -> None:
        self._conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return pickle.loads(self._conn.recv_bytes())  # noqa: S301 - a pipe to our own child (or parent)

    def poll(self, timeout: float) -> bool:
        return self._conn.poll(timeout)

    def close(self) -> None:
        self._conn.close()
