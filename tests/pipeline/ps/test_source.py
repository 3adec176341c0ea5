"""Nothing in pipeline/ps may deserialize objects: no pickle, marshal or torch.load on network bytes."""
from __future__ import annotations

import re
from pathlib import Path

import pipeline.ps

FORBIDDEN = re.compile(r"\b(pickle|cPickle|marshal|dill|cloudpickle|torch\.load|shelve)\b")


CONTROL_PIPE = "control_pipe.py"  # ps.server_processes: the driver <-> shard-process pipes


def test_ps_sources_never_deserialize_objects() -> None:
    sources = sorted(Path(pipeline.ps.__file__).parent.glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "protocol.py", "server.py", "client.py"}
    offenders = [f"{p.name}:{n}: {line.strip()}"
                 for p in sources
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if FORBIDDEN.search(line)]
    assert not offenders, offenders


def test_the_control_pipe_reads_only_pipes_never_the_network() -> None:
    """Its messages are data only anyway (the scan above covers it); it must also never face the network."""
    text = (Path(pipeline.ps.__file__).parent / CONTROL_PIPE).read_text()
    assert not re.search(r"\b(socket|Listener|Client|connect|bind|accept)\b", text.split('"""', 2)[2])
    # Only the proxy (parent) and the child entry point use it; the wire-facing modules do not.
    users = [p.name for p in Path(pipeline.ps.__file__).parent.glob("*.py") if "control_pipe" in p.read_text()
             and p.name != CONTROL_PIPE]
    assert sorted(users) == ["shard_process.py", "shard_proxy.py"], users
