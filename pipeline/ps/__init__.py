"""Parameter server: wire protocol, server shards (sync, async, ssp, average), worker client.

The server runs in threads next to the SparkSession (or in a task); it is built from one
``PSSettings`` and barrier tasks connect with ``PSClient`` using the per-run secret from
``new_secret()``. Nothing here deserializes Python objects from the network.
"""
from __future__ import annotations

import secrets

from pipeline.ps.client.ps_client import PSClient, ServerInfo
from pipeline.ps.state.optim import OptimizerSpec
from pipeline.ps.server.parameter_server import ParameterServer
from pipeline.ps.settings import PSSettings

SECRET_BYTES = 32


def new_secret() -> bytes:
    """A fresh per-run HMAC secret (32 random bytes); give it to tasks inside the barrier closure."""
    return secrets.token_bytes(SECRET_BYTES)


__all__ = ["OptimizerSpec", "ParameterServer", "PSClient", "PSSettings", "ServerInfo", "new_secret"]
