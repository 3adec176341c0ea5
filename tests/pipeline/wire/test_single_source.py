"""What the wire owns is defined there once: the parameter server and the stage links use it instead of
keeping copies (issue 14 follow-up) that could drift apart."""
from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

import pipeline
from pipeline.errors import PSError
from pipeline.parallel import link
from pipeline.ps.transport import listener
from pipeline.wire import handshake, sockets
from pipeline.wire.deadline import Timeout, deadline_after

ROOT = Path(pipeline.__file__).parent
USERS = [ROOT / "parallel" / "link.py", *sorted((ROOT / "ps").glob("*.py"))]

# A definition (or the call that would re-implement one) that belongs to pipeline.wire alone.
WIRE_ONLY = {
    "the handshake deadline": re.compile(r"^\s*HANDSHAKE_S\s*=", re.M),
    "a verified claim": re.compile(r"^class Claim\b", re.M),
    "an ERROR frame sender": re.compile(r"^def send_(error|refusal)\b", re.M),
    "a listening socket": re.compile(r"\bsocket\.create_server\("),
    "a wait's deadline": re.compile(r"\bdef deadline\("),
}


@pytest.mark.parametrize("what", sorted(WIRE_ONLY))
def test_only_the_wire_defines(what: str) -> None:
    offenders = [path.name for path in USERS if WIRE_ONLY[what].search(path.read_text())]
    assert not offenders, f"{what} re-defined outside pipeline.wire in {offenders}"


def test_listener_and_link_share_the_wires_handshake_constant_and_claim() -> None:
    assert listener.HANDSHAKE_S is handshake.HANDSHAKE_S is link.HANDSHAKE_S
    assert listener.Claim is handshake.Claim


def test_one_way_to_turn_a_wait_into_a_deadline() -> None:
    assert not hasattr(Timeout, "deadline")  # deadline_after takes a Timeout or seconds alike
    assert abs(deadline_after(Timeout(5.0)) - deadline_after(5.0)) < 1.0


def test_the_shard_listener_binds_through_the_wire() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        busy = listener.ShardListener("127.0.0.1", port, shard_index=0, cond=None, stats=None,
                                      max_connections=1, secret=b"s", step_timeout=None, owner=None)
        with pytest.raises(PSError, match=f"could not bind 127.0.0.1:{port}.*check ps.host"):
            busy.bind()
    free = listener.ShardListener("127.0.0.1", 0, shard_index=0, cond=None, stats=None, max_connections=1,
                                  secret=b"s", step_timeout=None, owner=None)
    host, port = free.bind()
    try:
        assert host == "127.0.0.1" and port > 0
        with sockets.listen("127.0.0.1", 0, backlog=1) as wire_listener:  # the wire's buffer sizes
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                assert free._listener.getsockopt(socket.SOL_SOCKET, opt) == \
                    wire_listener.getsockopt(socket.SOL_SOCKET, opt)
    finally:
        free._listener.close()
