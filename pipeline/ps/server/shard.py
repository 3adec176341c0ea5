"""One parameter-server shard: the state of one contiguous slice ``[start, end)`` of the flat parameter
vector, served to every rank (all ``ps.mode``s). It puts together parts that each own one thing:

* ``core.ShardCore``: parameters, optimizer, version, generation, and the condition all parts share;
* ``policies``: how pushes become updates and when pulls are answered, per consistency mode;
* ``listener.ShardListener``: the socket, a thread per connection, the handshake;
* ``dispatch``: the request loop and one handler per message type;
* ``failures``, ``stats``, ``connection.Roster``: failed, connected and finished ranks, and counters;
* ``shard_requests.ShardRequests``: what the request handlers ask of a shard (dispatch.RequestContext).

``pipeline.ps.server.parameter_server.ParameterServer`` is the driver's facade over ``ps.shards`` of these. A shard only
knows its own slice; it announces the whole layout (every shard's address and range) in its WELCOME so
a worker that reached any shard can reach all of them, which is also what lets a shard live on another
host. Failures are shared through ``failure_sink`` so that every shard fails its waiters with the same
root cause (``failures.FailureBoard``). Compression: the server accepts exactly one push dtype, the
configured one, and accumulates it into fp32; PARAMS are always fp32.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from pipeline.errors import PSError, WorkerFailure
from pipeline.ps.state.buffers import BufferStore
from pipeline.ps.modes.compression import wire_dtype
from pipeline.ps.transport.connection import RankConnection, Roster, ShardAddress, peer_host
from pipeline.ps.state.core import ShardCore
from pipeline.ps.server.dispatch import serve_requests
from pipeline.ps.server.failures import FailureLedger, FailureSink, drop_text
from pipeline.ps.transport.listener import HandshakeRejected, ShardListener
from pipeline.ps.server.messages import ERROR
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.modes.policies import make_policy
from pipeline.ps.transport.protocol import Channel
from pipeline.ps.settings import PSSettings
from pipeline.ps.server.shard_requests import ShardRequests
from pipeline.ps.transport.shm_offer import rings_possible
from pipeline.ps.server.stats import ShardStats
from pipeline.wire.frames import U32_MAX
from pipeline.wire.handshake import Claim

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import ServerCert

logger = logging.getLogger(__name__)

_CLOSE_GRACE_S = 1.0  # how long close() lets woken waiters deliver their ERROR frames

MetricsHook = Callable[[int, dict], None]


class ShardServer(ShardRequests):
    """One shard of the parameter server. Use as a context manager or call ``start()``/``close()``.

    Standing alone (the defaults) it is a complete one-shard server owning ``[0, N)``.
    """

    def __init__(self, initial: torch.Tensor, settings: PSSettings, *, world_size: int, secret: bytes,
                 host: str, port: int = 0, generation: int = 1, on_metrics: MetricsHook | None = None,
                 shard_index: int = 0, start: int = 0, total_params: int | None = None,
                 failure_sink: FailureSink | None = None, buffers: BufferStore | None = None,
                 tls: ServerCert | None = None, sparse: Any = None) -> None:
        if not 1 <= world_size <= U32_MAX:
            raise PSError(f"world_size must be >= 1, got {world_size}")
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise PSError("the PS secret must be at least 16 random bytes (use pipeline.ps.new_secret())")
        if not host:
            raise PSError("the PS needs an explicit host to bind (ps.host or spark.driver.host)")
        # Sync mode on one host: the parameters in a page local workers map (pipeline.wire.shared_page).
        self._core = ShardCore(initial, settings, generation=generation, shared_page=tls is None and
                               settings.shared_memory_bytes > 0 and settings.consistency.mode == "sync")
        self._cond = self._core.cond
        self._settings = settings
        self._shm_cap = 0 if tls is not None else settings.shared_memory_bytes  # ps.tls: all on the wire
        self._shm_used = 0  # bytes of /dev/shm this shard's connections' rings hold now
        self._push_dtypes = frozenset({wire_dtype(settings.compression)})
        # Receive buffer per connection: a top-k push may carry up to 8 bytes per parameter.
        self._push_buf_bytes = self._core.num_params * (8 if settings.compression == "topk" else 4)
        self._shard_index = shard_index
        self._start = start
        self._total_params = self._core.num_params if total_params is None else total_params
        self._layout: list[ShardAddress] | None = None  # set by the facade, or at start() when alone
        self._failure_sink = failure_sink
        self._on_metrics = on_metrics
        self._world_size = world_size
        self._buffers = buffers  # the model's buffers: shard 0 of a server only (pipeline.ps.state.buffers)

        self._roster = Roster(world_size)
        self._ledger = FailureLedger()
        self._stats = ShardStats()
        self._policy = make_policy(self._core, self._roster, self._ledger, self._stats, settings.consistency)
        # Sparse tables (pipeline.ps.sparse.store): shard 0's, or with ps.placement=hosts every shard's part.
        self._sparse = sparse
        if sparse is not None:
            sparse.attach(self._core, self._policy)
        self._replying = 0  # requests woken by fail()/close() that still have to send their ERROR
        self._listener = ShardListener(host, port, shard_index=shard_index, cond=self._cond, stats=self._stats,
                                       max_connections=2 * world_size + 8, secret=bytes(secret),
                                       step_timeout=settings.step_timeout, owner=self, tls=tls,
                                       tensor_threads=settings.server_threads)
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> ShardServer:
        """Bind ``host:port`` (port 0 = OS-chosen) and start the accept thread."""
        with self._cond:
            if self._started:
                raise PSError("the parameter server was already started")
            if self._core.closed:
                raise PSError("the parameter server is closed")
            self._started = True
        host, port = self._listener.bind()
        end = self._start + self._core.num_params
        if self._layout is None:  # standalone: the only shard
            self._layout = [ShardAddress(host, port, self._start, end)]
        self._listener.start_accepting()
        logger.info("parameter server shard %s listening on %s:%s (world_size=%s, params [%s, %s), "
                    "generation=%s)", self._shard_index, host, port, self._world_size, self._start, end,
                    self._core.generation)
        return self

    def set_layout(self, layout: list[ShardAddress]) -> None:
        """The facade hands every shard the whole layout before any worker can connect."""
        mine = layout[self._shard_index]
        if (mine.start, mine.end) != (self._start, self._start + self._core.num_params):
            raise PSError(f"layout gives shard {self._shard_index} [{mine.start}, {mine.end}) but it owns "
                          f"[{self._start}, {self._start + self._core.num_params})")
        with self._cond:
            self._layout = list(layout)

    def __enter__(self) -> ShardServer:
        return self.start() if not self._started else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving. Idempotent. Waiters get an ERROR first, then every socket is shut down."""
        core = self._core
        with self._cond:
            if core.closed:
                return
            core.closed = True
            if core.abort_reason is None:
                core.abort_reason = "the parameter server is shutting down"
            self._cond.notify_all()
            grace = time.monotonic() + _CLOSE_GRACE_S
            while self._replying and (left := grace - time.monotonic()) > 0:
                self._cond.wait(left)
        self._listener.close()
        if core.page is not None:
            core.page.close()
        logger.info("parameter server closed at version %s", core.version)

    def fail(self, reason: str) -> None:
        """Abort: every current and future waiter gets an ERROR frame carrying ``reason``."""
        with self._cond:
            if self._core.abort_reason is None:
                self._core.abort_reason = reason
            self._cond.notify_all()
        logger.warning("parameter server aborted: %s", reason)

    def new_generation(self, generation: int | None = None) -> int:
        """Start a new barrier attempt, keeping parameters, optimizer state and version.

        Old connections are cut (their gradients for the unfinished step are discarded, so each
        (rank, step) is still applied at most once), failures/finished ranks and a ``fail()`` abort
        are cleared. Returns the new generation (default: current + 1).
        """
        core = self._core
        with self._cond:
            if core.closed:
                raise PSError("the parameter server is closed")
            new = core.generation + 1 if generation is None else generation
            if not 0 <= new <= U32_MAX or new == core.generation:
                raise PSError(f"new generation must differ from {core.generation} and fit u32, got {new}")
            core.generation = new
            old = self._roster.cut_locked()
            self._ledger.clear_locked()
            self._stats.discarded_pushes += self._policy.new_generation_locked()
            self._stats.generations += 1
            core.abort_reason = None
            self._cond.notify_all()
        for conn in old:
            conn.channel.close()
        logger.info("parameter server moved to generation %s at version %s", new, core.version)
        return new

    # -- read-only views ---------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        if self._listener.address is None:
            raise PSError("the parameter server is not started")
        return self._listener.address

    @property
    def version(self) -> int:
        with self._cond:
            return self._core.version

    @property
    def generation(self) -> int:
        with self._cond:
            return self._core.generation

    @property
    def shard_index(self) -> int:
        return self._shard_index

    @property
    def num_params(self) -> int:
        return self._core.num_params

    @property
    def consistency(self) -> Consistency:
        return self._settings.consistency

    @property
    def waiting_ranks(self) -> dict[int, int]:
        """ssp: ranks blocked by the staleness bound now, with the clock each wants to start."""
        with self._cond:
            return self._policy.waiting_locked()

    def parameters(self) -> torch.Tensor:
        return self._core.parameters()

    @property
    def failures(self) -> dict[int, WorkerFailure]:
        with self._cond:
            return dict(self._ledger.failures)

    @property
    def root_failures(self) -> dict[int, WorkerFailure]:
        """Failures that were not just the fallout of an earlier one: what a report should name."""
        with self._cond:
            return self._ledger.root_failures_locked()

    @property
    def silences(self) -> dict[int, tuple[float, str]]:
        """{rank: (seconds since it was last heard, its host)} of the ranks connected now."""
        with self._cond:
            return self._roster.silences_locked()

    @property
    def registered_ranks(self) -> set[int]:
        """Ranks that authenticated in this generation (connected now, finished or failed since)."""
        with self._cond:
            return set(self._roster.registered)

    @property
    def aborted(self) -> bool:
        """Whether fail() was called or a rank failed: the current attempt cannot complete."""
        with self._cond:
            return self._core.abort_reason is not None or bool(self._ledger.failures)

    @property
    def finished_ranks(self) -> set[int]:
        with self._cond:
            return set(self._roster.finished)

    @property
    def stats(self) -> dict[str, Any]:
        with self._cond:
            return self._stats.report_locked(
                live_bytes=self._listener.live_bytes_locked(), requests_in_flight=self._replying,
                mode=self._settings.consistency.mode, compression=self._settings.compression,
                clock_by_rank=self._policy.clock) | (
                    {"sparse": self._sparse.stats_locked()} if self._sparse is not None else {})

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Parameters, optimizer state and version, for checkpoints (deep copies, plain types only)."""
        with self._cond:
            return {**self._core.state_locked(),
                    # async: each rank's next step (its data position); the counters prove at-most-once.
                    "clocks": self._policy.checkpoint_clocks_locked(),
                    "steps_applied_by_rank": dict(self._stats.steps_applied_by_rank),
                    **({"sparse": self._sparse.state_locked()} if self._sparse is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; refused while a step is half-pushed. The optimizer kind must
        match; its hyperparameters come from *this* server's spec, its state from the checkpoint."""
        self._core.check_restorable(state)
        with self._cond:
            if self._policy.pending_locked():
                raise PSError(f"cannot load state while step {self._core.version} is partly pushed")
            self._core.restore_locked(state)
            if self._sparse is not None and state.get("sparse") is not None:
                self._sparse.restore_locked(state["sparse"])
            self._policy.restore_clocks_locked(dict(state.get("clocks") or {}))
            self._stats.steps_applied_by_rank = {
                int(r): int(n) for r, n in dict(state.get("steps_applied_by_rank") or {}).items()}
            self._cond.notify_all()

    # -- failures ----------------------------------------------------------------------------------
    def mark_failure(self, failure: WorkerFailure, consequence: bool, generation: int) -> bool:
        """Record a rank's failure (from this shard or mirrored from another) and wake every waiter.
        First record per rank wins; False if the rank already failed/finished or the generation moved."""
        with self._cond:
            if self._core.closed or generation != self._core.generation:
                return False
            if failure.rank in self._roster.finished or not self._ledger.record_locked(failure, consequence):
                return False
            # Logged before anyone can see the failure, so the line never outlives what it reports
            # (a reader that returns on it may tear logging down next).
            logger.warning("rank %s failed (shard %s): %s", failure.rank, self._shard_index, failure.error)
            self._cond.notify_all()
        return True

    def record_failure(self, conn: RankConnection, error: str, log_tail: str = "",
                       consequence: bool = False, *, retryable: bool = True) -> None:
        with self._cond:
            if conn.superseded or self._core.closed or conn.generation != self._core.generation:
                return
            if conn.rank in self._ledger.failures or conn.rank in self._roster.finished:
                return
        failure = WorkerFailure(conn.rank, error, log_tail, retryable)
        if self._failure_sink is not None:
            # Outside our lock: the sink takes every shard's lock in turn (never two at once).
            self._failure_sink(failure, consequence, conn.generation)
        else:
            self.mark_failure(failure, consequence, conn.generation)

    def record_drop(self, conn: RankConnection, what: str) -> None:
        """A drop before FINISH is a failure, marked a consequence when it followed another failure."""
        with self._cond:
            text, consequence = drop_text(
                conn.rank, what, last_step=self._stats.last_step_by_rank.get(conn.rank),
                earlier=sorted(r for r in self._ledger.failures if r != conn.rank),
                aborted=self._core.abort_reason)
        self.record_failure(conn, text, consequence=consequence)

    # -- what the listener asks (listener.ConnectionHost) ------------------------------------------
    def current_generation(self) -> int:
        return self.generation

    def admit(self, claim: Claim, channel: Channel) -> tuple[RankConnection, dict[str, Any]]:
        """Register an authenticated rank; raises HandshakeRejected when it may not join now."""
        rank, core = claim.rank, self._core
        with self._cond:
            reason = None
            if claim.generation != core.generation:
                reason = (f"rank {rank} belongs to generation {claim.generation} but the server is at "
                          f"generation {core.generation}; stale task from an earlier attempt")
            elif rank >= self._world_size:
                reason = f"rank {rank} is out of range for world_size {self._world_size}"
            elif core.abort_reason is not None:
                reason = core.abort_reason
            elif rank in self._roster.finished or rank in self._ledger.failures:
                reason = (f"rank {rank} already {'finished' if rank in self._roster.finished else 'failed'} "
                          f"in generation {core.generation}; one connection per rank per generation")
            elif rank in self._roster.connected:
                reason = f"rank {rank} is already connected in generation {core.generation}"
            if reason is not None:
                raise HandshakeRejected(reason, ERROR, generation=claim.generation, rank=rank)
            conn = RankConnection(rank, core.generation, channel, bytearray(self._push_buf_bytes),
                                  host=peer_host(channel))
            self._roster.add_locked(conn)
            version = core.version
            clock = self._policy.clock_on_connect_locked(rank)
            assert self._layout is not None
            layout = [a.to_dict() for a in self._layout]
        channel.max_elements = core.num_params
        welcome = {"num_params": self._total_params, "version": version, "shard": self._shard_index,
                   "shards": layout, "world_size": self._world_size, "generation": conn.generation,
                   "clock": clock, "compression": self._settings.compression,
                   "topk_ratio": self._settings.topk_ratio, **self._settings.consistency.to_dict(),
                   "buffer_words": self._buffers.words if self._buffers is not None else 0,
                   "sparse_shards": self._sparse.parts if self._sparse is not None else 1,
                   "shared_memory": rings_possible(channel, self._shm_cap)}  # pipeline.ps.transport.shm_offer
        return conn, welcome

    def serve(self, conn: RankConnection, peer: tuple) -> None:
        serve_requests(self, conn, peer)

    def release_locked(self, conn: RankConnection) -> None:
        self._roster.release_locked(conn)
