"""Real ranks get in while a flood of idle and garbage connections hits the parameter server (issue 19,
item 3): unauthenticated sockets have their own slots, the oldest evicted at the cap, and never take
the admitted ranks' slots. The flood is real (sockets on 127.0.0.1), bounded in count and time."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from pipeline.wire.frames import MAGIC
from pipeline.wire.pending import PENDING_CAP, PendingSlots
from pipeline.wire.tls import new_job_cert

FLOOD_SOCKETS = 200
FLOOD_S = 3.0


class Flood:
    """Opens up to FLOOD_SOCKETS connections within FLOOD_S: every other one idle (it sends nothing and
    stays open), the rest garbage (bad magic, a truncated header, random bytes). ``started`` is set once
    more sockets are open than the server has pending slots."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.socks: list[socket.socket] = []
        self.started = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        garbage = [b"GET / HTTP/1.1\r\n\r\n", MAGIC + b"\x01", os.urandom(64), b"\0" * 48]
        end = time.monotonic() + FLOOD_S
        for i in range(FLOOD_SOCKETS):
            if self.stop.is_set() or time.monotonic() > end:
                break
            try:
                sock = socket.create_connection(self.address, timeout=1)
                self.socks.append(sock)
                if i % 2:
                    sock.sendall(garbage[i % len(garbage)])
            except OSError:
                pass  # evicted or refused already: that is the server defending itself
            if i == PENDING_CAP + 16:
                self.started.set()
            time.sleep(0.005)  # spread over the clients' connect and first steps
        self.started.set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(FLOOD_S + 5)
        for sock in self.socks:
            sock.close()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_real_ranks_connect_and_train_during_a_flood(make_server, make_client, background, tls) -> None:
    cert = new_job_cert() if tls else None
    server = make_server(world_size=2, tls=cert)
    flood = Flood(server.address)
    try:
        assert flood.started.wait(FLOOD_S + 2)

        def rank(r: int):
            c = make_client(server, r, timeout_s=10.0, expected_params=6,
                            tls=cert.pinned() if cert is not None else None)
            c.connect()
            for step in range(3):
                version, _ = c.pull(step)
                assert version == step
                c.push(step, torch.full((6,), float(r + 1)))
            version, params = c.pull(3)
            result = (version, params.clone())
            c.finish()
            return result

        runs = [background(lambda r=r: rank(r)) for r in (0, 1)]
        results = [run.result() for run in runs]
    finally:
        flood.close()
    assert [v for v, _ in results] == [3, 3]
    # sgd lr 1 on the mean gradient 1.5, three steps
    assert torch.allclose(results[0][1], torch.arange(6, dtype=torch.float32) - 4.5)
    assert server.failures == {}
    # The flood did exceed the pending slots (else this test could not fail on a shared cap).
    assert server.stats["rejected_connections"] > 0


def test_pending_slots_evict_the_oldest_first() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    e, f = socket.socketpair()

    class Item:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

    slots = PendingSlots(cap=2)
    first, second, third = Item(a), Item(c), Item(e)
    assert slots.add(first) is None and slots.add(second) is None
    assert slots.add(third) is first and len(slots) == 2
    assert b.recv(1) == b""  # the evicted socket was shut down: its peer sees EOF
    assert slots.settle(first) is True  # its handshake thread learns it was evicted
    assert slots.settle(second) is False and slots.settle(third) is False and len(slots) == 0
    for s in (a, b, c, d, e, f):
        s.close()
