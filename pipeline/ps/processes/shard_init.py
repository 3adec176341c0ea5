"""What a shard process is built from (``ps.server_processes``): the first message down its requests pipe."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ShardInit:
    """Everything a child needs to build its shard; sent once, over the requests pipe."""

    kind: str  # a key of HOSTED
    initial: Any  # the fp32 slice this shard owns (a torch.Tensor)
    settings: Any  # pipeline.ps.settings.PSSettings
    world_size: int
    secret: bytes = field(repr=False)
    host: str
    port: int
    generation: int
    shard_index: int
    start: int
    total_params: int
    buffers: Any = None  # pipeline.ps.state.buffers.BufferSpec (shard 0 only): reports go back to the driver
    tls: Any = None  # pipeline.wire.tls.ServerCert
    report_failures: bool = False  # True: failures go to the parent's board, which mirrors them back
    forward_metrics: bool = False
    sparse: Any = None  # pipeline.ps.sparse.spec.SparseSpec: this shard keeps its part of every sparse table
    sparse_parts: int = 1  # the rows are spread over shards [0, sparse_parts): this shard holds part shard_index
