"""Nothing in pipeline/ps may deserialize objects: no pickle, marshal or torch.load on network bytes."""
from __future__ import annotations

import re
from pathlib import Path

import pipeline.ps

FORBIDDEN = re.compile(r"\b(pickle|cPickle|marshal|dill|cloudpickle|torch\.load|shelve)\b")


CONTROL_PIPE = "processes/control_pipe.py"  # ps.server_processes: the driver <-> shard-process pipes
PS = Path(pipeline.ps.__file__).parent


def test_ps_sources_never_deserialize_objects() -> None:
    sources = sorted(PS.rglob("*.py"))
    assert {str(p.relative_to(PS)) for p in sources} >= {"__init__.py", "transport/protocol.py",
                                                         "server/parameter_server.py", "client/ps_client.py"}
    offenders = [f"{p.relative_to(PS)}:{n}: {line.strip()}"
                 for p in sources
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if FORBIDDEN.search(line)]
    assert not offenders, offenders


def test_the_control_pipe_reads_only_pipes_never_the_network() -> None:
    """Its messages are data only anyway (the scan above covers it); it must also never face the network."""
    text = (PS / CONTROL_PIPE).read_text()
    assert not re.search(r"\b(socket|Listener|Client|connect|bind|accept)\b", text.split('"""', 2)[2])
    # Only the proxy (parent) and the child entry point use it; the wire-facing modules do not.
    users = [p.name for p in PS.rglob("*.py") if "processes.control_pipe import" in p.read_text()]
    assert sorted(users) == ["shard_process.py", "shard_proxy.py"], users


def test_the_control_codec_reaches_the_network_only_behind_the_handshake() -> None:
    """ps.placement=hosts carries the same data-only messages over TCP: only the control link uses the
    codec besides the pipe, and it authenticates both ways before it reads a message."""
    users = sorted(p.name for p in PS.rglob("*.py") if "processes.codec import" in p.read_text())
    assert users == ["control_link.py", "control_pipe.py"], users
    link = (PS / "processes" / "control_link.py").read_text()
    assert "client_handshake(" in link and "mutual=True" in link
    registry = (PS / "processes" / "registry.py").read_text()
    admit = registry.split("def _admit", 1)[1].split("\n    def ", 1)[0]
    assert admit.index("server_handshake(") < admit.index("link.recv()"), "a message read before the handshake"
    assert "mutual=True" in admit
