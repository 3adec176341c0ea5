"""Nothing in pipeline/ps may deserialize objects: no pickle, marshal or torch.load on network bytes."""
from __future__ import annotations

import re
from pathlib import Path

import pipeline.ps

FORBIDDEN = re.compile(r"\b(pickle|cPickle|marshal|dill|cloudpickle|torch\.load|shelve)\b")


def test_ps_sources_never_deserialize_objects() -> None:
    sources = sorted(Path(pipeline.ps.__file__).parent.glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "protocol.py", "server.py", "client.py"}
    offenders = [f"{p.name}:{n}: {line.strip()}"
                 for p in sources
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if FORBIDDEN.search(line)]
    assert not offenders, offenders
