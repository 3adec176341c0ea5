"""The ``ps.*`` keys: where the parameter server runs, how updates combine, what travels and how.

Apart from ``schema`` because the parameter server's keys are a concept of their own (its modes, wire,
placement and processes) and the biggest section of the config.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from pipeline.config.section import Section as _Section
from pipeline.config.sparse import SparseConfig


class PSConfig(_Section):
    # sync: BSP, average every rank's gradient of step t; async: apply each push on arrival;
    # ssp: bounded staleness (see staleness); average: local SGD, parameters averaged every sync_every steps;
    # auto: the cost model picks (sync unless train.auto.allow grants async / ssp / average).
    mode: Literal["sync", "async", "ssp", "average", "auto"] = "sync"
    # ssp: how many steps a worker may run ahead of the slowest before it blocks (0 = sync).
    staleness: int = Field(2, ge=0, le=1000)
    # average: local steps between two parameter averages (and one after the last step).
    sync_every: int = Field(4, ge=1)
    # What workers push: none (fp32), fp16/bf16 (half the bytes, fp32 sums on the server),
    # topk (the topk_ratio largest entries + error feedback kept on the worker); auto: the cost model picks
    # (none unless train.auto.allow grants compression).
    compression: Literal["none", "fp16", "bf16", "topk", "auto"] = "none"
    topk_ratio: float = Field(0.01, gt=0, le=1)  # ps.compression=topk: the fraction of gradient entries sent per step
    # Parameter-server shards: balanced contiguous slices of the parameters, each with its own
    # listener and threads (all on the driver); workers talk to every shard concurrently.
    shards: int = Field(1, ge=1, le=64)
    # Address the PS binds to; null means spark.driver.host (Spark Connect: this client's own address
    # toward the server). Never a wildcard: no process of a run listens on every interface (issue 19).
    host: Optional[str] = Field(None, min_length=1)

    @field_validator("host")
    @classmethod
    def _not_a_wildcard(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value.strip("[] ") in ("0.0.0.0", "::", "*"):
            raise ValueError(f"{value!r} would listen on every interface; give the address of this machine that "
                             "the executors reach (or leave it unset for spark.driver.host)")
        return value

    # The default deadline of every wait whose own timeouts.* key is unset (a step's gradients from all
    # workers, a pull, a connect, a stage link).
    timeout_s: float = Field(120.0, gt=0)
    # Where the PS runs: `driver` (the process holding the SparkSession: the driver, or a Spark Connect
    # client) or `task` (inside rank 0's barrier task, its address shared with allGather; for clusters
    # whose executors cannot reach the driver/client). Same protocol, modes and checkpoints; with `task`
    # the final parameters come back as result rows and progress is reported after each attempt.
    # `hosts`: one server shard per worker host (a process the host's first barrier task starts), each
    # serving a 1/hosts slice, so each worker link carries 2M(H-1)/H bytes a step instead of 2M and the
    # driver's link none; the driver stays the coordinator (roster, failures, progress, checkpoints, early
    # stopping, the final merge) over an authenticated control link per shard (pipeline/ps/server/spread.py).
    # ps.shards and ps.server_processes do not apply (the hosts are the shards); needs train.backend=ps.
    # auto: the cost model picks driver or hosts from the measured links (task only by name: it is for
    # clusters whose executors cannot reach the driver, which a probe from the driver cannot tell).
    placement: Literal["driver", "task", "hosts", "auto"] = "driver"
    # async/ssp, staleness-aware updates (pipeline/ps/modes/staleness.py documents both rules). staleness_scale:
    # inverse weighs each gradient by 1/(1+s), s = versions applied since the rank pulled; none = full weight.
    staleness_scale: Literal["inverse", "none"] = "inverse"
    # async/ssp server SGD momentum; null: train.momentum less the momentum asynchrony implies
    # (tau/(1+tau), tau = parallelism.data-1 in async, min(ps.staleness, parallelism.data-1) in ssp).
    async_momentum: Optional[float] = Field(None, ge=0, lt=1)
    # TLS on every PS connection and pipeline stage link (pipeline/wire/tls.py): a per-job self-signed
    # certificate whose SHA-256 fingerprint travels with the job secret; workers pin it. The HMAC
    # handshake still runs inside. Off: plain TCP (authenticated, not encrypted).
    tls: bool = False
    # Overlap (issue 17): each worker's gradient goes out in buckets of about bucket_mb MB while backward
    # still runs (per-parameter post-accumulate-grad hooks, DDP's way), each bucket summed, stepped and
    # answered by its own server shard; off, the whole gradient is pushed after backward. With ps.shards
    # > 1 the shards are the buckets; with train.clip_grad_norm (one global norm) there is one bucket.
    # Off by default: it pays where the server has cores of its own; on a box whose cores the workers
    # already fill (2 workers + the PS on 2 cores) the server's work during backward slows backward more
    # than the push it hides (bench/step_profile_bench.py --compare ps.overlap=true measures it).
    overlap: bool = False
    bucket_mb: float = Field(1.0, gt=0, le=1024)  # overlap: the bucket (server slice) size in MB
    # Each server shard (ps.shards of them) in a child process of its own on the same host, same address,
    # secret and wire (pipeline/ps/processes/shard_proxy.py): the shards use one core each instead of sharing one GIL.
    # A killed shard process fails the attempt naming it; the retry resumes from the newest checkpoint.
    server_processes: bool = False
    # OpenMP threads each server thread (or shard process) uses for its sums and optimizer step, set in
    # those threads only (pipeline/ps/server/tensor_threads.py); 0: torch's default (OMP_NUM_THREADS, else the
    # cores). Null: 1 where the workers run on the server's own cores (a local[...] or local-cluster[...]
    # master; ps.placement=hosts, each shard beside its host's ranks), whose memory-bound passes a second
    # thread would only take from a worker; else 0.
    server_threads: Optional[int] = Field(None, ge=0, le=1024)
    # Workers on the PS's own host move payloads through shared-memory rings (/dev/shm, pipeline/wire/shm.py),
    # headers still on the authenticated socket: two per connection, each its slice's fp32 bytes + 256 KB;
    # at most this many MB per PS shard together (connections beyond it stay on TCP); 0: TCP. Not with ps.tls.
    shared_memory_mb: float = Field(1024.0, ge=0, le=1 << 20)
    # Sparse embedding tables on the PS (pipeline/config/sparse.py, docs/training.md "Sparse embedding tables").
    sparse: SparseConfig = Field(default_factory=SparseConfig)
