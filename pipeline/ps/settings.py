"""What one parameter server runs with, checked once and passed whole (driver, task-hosted PS, tests).

Why one frozen value instead of keyword arguments: the same settings travel from the config through the
launcher to every shard and stage server; checking them at construction means a bad value fails on the
driver before any worker is launched, and a server can never run with half of a changed setting.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.errors import PSError
from pipeline.ps.modes.compression import topk_count, wire_dtype
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.state.optim import OptimizerSpec
from pipeline.ps.server.tensor_threads import SERVER_THREADS_KEY
from pipeline.wire.deadline import STEP_KEY, Timeout

SHARDS_KEY = "ps.shards"
TOPK_RATIO_KEY = "ps.topk_ratio"
BUCKET_KEY = "ps.bucket_mb"
MAX_BUCKETS = 64  # the most shards a server runs (ps.shards' own cap)


@dataclass(frozen=True)
class PSSettings:
    """The optimizer, consistency mode, push compression, shard count and step deadline of one server."""

    optimizer: OptimizerSpec
    consistency: Consistency = Consistency()
    compression: str = "none"
    topk_ratio: float = 0.01
    shards: int = 1
    # Every wait of a step (its pushes, a pull, an ssp/average turn, a previous update) and every frame
    # of a request; its error text names the key that raises it.
    step_timeout: Timeout = Timeout.of(60.0, STEP_KEY)
    # ps.overlap with ps.bucket_mb: with shards == 1, the parameters are cut into slices of about this
    # many bytes instead (one shard each: the gradient buckets a worker pushes while backward runs,
    # pipeline.worker.buckets); 0: exactly ``shards`` slices.
    bucket_bytes: int = 0
    # ps.server_processes: each shard runs in a child process of its own (pipeline.ps.processes.shard_proxy)
    server_processes: bool = False
    # ps.shared_memory_mb: the /dev/shm bytes one shard's rings may hold together, for workers on this
    # host (pipeline.wire.shm, pipeline.ps.transport.shm_offer); connections beyond it stay on TCP; 0: TCP only
    shared_memory_bytes: int = 1024 << 20
    # ps.server_threads: OpenMP threads of each connection thread's tensor math (pipeline.ps.server.tensor_threads);
    # 0: torch's default. The launcher resolves the key's null (pipeline.launch.plans.ps_settings).
    server_threads: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, OptimizerSpec):
            raise PSError(f"PSSettings.optimizer must be an OptimizerSpec, got {type(self.optimizer).__name__}")
        if not isinstance(self.consistency, Consistency):
            raise PSError(f"PSSettings.consistency must be a Consistency, got {type(self.consistency).__name__}")
        if not isinstance(self.step_timeout, Timeout):
            raise PSError(f"PSSettings.step_timeout must be a pipeline.wire.Timeout, got "
                          f"{type(self.step_timeout).__name__}")
        wire_dtype(self.compression)  # names ps.compression and its choices when unknown
        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)):
            raise PSError(f"{TOPK_RATIO_KEY} must be a number, got {self.topk_ratio!r}")
        object.__setattr__(self, "topk_ratio", float(self.topk_ratio))
        if self.compression == "topk":
            topk_count(1, self.topk_ratio)  # the ratio's own range check
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise PSError(f"{SHARDS_KEY} must be an integer >= 1, got {self.shards!r}")
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise PSError(f"{BUCKET_KEY} must give a bucket size >= 0 bytes, got {self.bucket_bytes!r}")
        if isinstance(self.shared_memory_bytes, bool) or not isinstance(self.shared_memory_bytes, int) \
                or self.shared_memory_bytes < 0:
            raise PSError(f"ps.shared_memory_mb must give a budget >= 0 bytes, got {self.shared_memory_bytes!r}")
        if isinstance(self.server_threads, bool) or not isinstance(self.server_threads, int) \
                or self.server_threads < 0:
            raise PSError(f"{SERVER_THREADS_KEY} must be an integer >= 0 (0: torch's default), got "
                          f"{self.server_threads!r}")
        if not isinstance(self.server_processes, bool):
            raise PSError(f"ps.server_processes must be true or false, got {self.server_processes!r}")

    def shards_for(self, num_params: int) -> int:
        """How many slices ``num_params`` fp32 parameters are served in: ``shards``, or with buckets on and
        ``shards == 1`` one per ``bucket_bytes`` (at most ``MAX_BUCKETS``, never more than parameters)."""
        if self.shards > 1 or not self.bucket_bytes:
            return self.shards
        return max(1, min(MAX_BUCKETS, num_params, -(-4 * num_params // self.bucket_bytes)))

    def for_slice(self, num_params: int) -> PSSettings:
        """These settings for a server of ``num_params`` parameters: never more shards than parameters
        (a pipeline stage may be smaller than ``ps.shards``)."""
        return dataclasses.replace(self, shards=min(self.shards, num_params), bucket_bytes=0)
