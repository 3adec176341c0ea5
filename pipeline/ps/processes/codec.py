"""The data-only message format of a shard's control channel (``ps.server_processes`` pipes,
``ps.placement: hosts`` authenticated links): JSON with tagged values, and tensors and bytes as raw buffers
after it. Objects are rebuilt only as the dataclasses named in ``_types()``, from their fields, which runs
their validation again. No object serializer is used: those construct whatever they are given, and torch's
multiprocessing reducers would share tensors through file descriptors.

Tags: ``{"$t": i, "dtype", "shape"}`` tensor, ``{"$b": i}`` bytes, ``{"$tuple": [...]}``,
``{"$set": [...]}``, ``{"$dict": [[k, v], ...]}`` (keys that are not plain strings), and
``{"$dc": name, "f": {...}}`` dataclass.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import struct
from typing import Any

LENGTH = struct.Struct("<Q")  # a message's frame count, before its frames


@functools.cache
def _types() -> dict[str, type]:
    """The dataclasses that may cross the pipe (imported late: this module is imported by both sides)."""
    from pipeline.errors import WorkerFailure
    from pipeline.ps.state.buffers import BufferSpec
    from pipeline.ps.transport.connection import ShardAddress
    from pipeline.ps.modes.consistency import Consistency
    from pipeline.ps.state.optim import OptimizerSpec
    from pipeline.ps.modes.schedule import ScheduleSpec
    from pipeline.ps.settings import PSSettings
    from pipeline.ps.processes.shard_init import ShardInit
    from pipeline.ps.sparse.rowopt import RowOptimizerSpec
    from pipeline.ps.sparse.spec import SparseSpec
    from pipeline.ps.sparse.table import RowPolicy, TableSpec
    from pipeline.wire.deadline import Timeout
    from pipeline.wire.tls import ServerCert

    return {t.__name__: t for t in (WorkerFailure, BufferSpec, ShardAddress, Consistency, OptimizerSpec,
                                    ScheduleSpec, PSSettings, ShardInit, Timeout, ServerCert, SparseSpec, TableSpec,
                                    RowOptimizerSpec, RowPolicy)}


def encode(obj: Any) -> list[bytes | memoryview]:
    """``obj`` as frames: the JSON document, then one raw buffer per tensor or bytes value in it."""
    import torch

    buffers: list[bytes | memoryview] = []

    def walk(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            buffers.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return {"$t": len(buffers) - 1, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        if isinstance(value, (bytes, bytearray, memoryview)):
            buffers.append(bytes(value))
            return {"$b": len(buffers) - 1}
        if isinstance(value, tuple):
            return {"$tuple": [walk(v) for v in value]}
        if isinstance(value, (set, frozenset)):
            return {"$set": [walk(v) for v in sorted(value)]}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in value):
                return {k: walk(v) for k, v in value.items()}
            return {"$dict": [[walk(k), walk(v)] for k, v in value.items()]}
        if dataclasses.is_dataclass(value) and type(value).__name__ in _types():
            return {"$dc": type(value).__name__,
                    "f": {f.name: walk(getattr(value, f.name)) for f in dataclasses.fields(value)}}
        raise TypeError(f"a shard control message cannot carry a {type(value).__name__}")

    document = json.dumps(walk(obj), separators=(",", ":")).encode("utf-8")
    return [document, *buffers]


def decode(frames: list[bytes]) -> Any:
    import torch

    types = _types()

    def walk(value: Any) -> Any:
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "$t" in value:
            dtype = getattr(torch, value["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown tensor dtype {value['dtype']!r}")
            raw = frames[1 + value["$t"]]
            flat = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            return flat.reshape(value["shape"])
        if "$b" in value:
            return bytes(frames[1 + value["$b"]])
        if "$tuple" in value:
            return tuple(walk(v) for v in value["$tuple"])
        if "$set" in value:
            return {walk(v) for v in value["$set"]}
        if "$dict" in value:
            return {walk(k): walk(v) for k, v in value["$dict"]}
        if "$dc" in value:
            cls = types.get(value["$dc"])
            if cls is None:
                raise ValueError(f"a shard control message does not carry {value['$dc']!r}")
            return cls(**{k: walk(v) for k, v in value["f"].items()})
        return {k: walk(v) for k, v in value.items()}

    return walk(json.loads(frames[0].decode("utf-8")))
