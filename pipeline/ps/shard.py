"""One parameter-server shard: a listener, a thread per worker connection, and the state of one
contiguous slice ``[start, end)`` of the flat parameter vector (all ``ps.mode``s).

``pipeline.ps.server.ParameterServer`` is the driver's facade over ``ps.shards`` of these. A shard
only knows its own slice; it announces the whole layout (every shard's address and range) in its
WELCOME so a worker that reached any shard can reach all of them, which is also what lets a shard
live on another host. Failures are shared through ``failure_sink`` so that every shard fails its
waiters with the same root cause (see ``server.FailureBoard``).

Design notes (the why):

* Consistency modes (``modes``): ``sync`` and ``average`` share the BSP path below (they differ only
  in how a complete step is applied); ``ssp`` sums each clock's gradients in a ring of
  ``staleness + 1`` buffers and applies clocks in order; ``async`` applies each push on arrival. Any
  update first waits for in-flight PARAMS sends (``_stepping``), so readers never see torn values.
* Compression (``compression``): the server accepts exactly one push dtype, the configured one, and
  accumulates it into fp32; PARAMS are always fp32.

* One flat fp32 parameter tensor and a real ``torch.optim`` optimizer over it (see ``optim``).
* BSP: every rank pushes its gradient for step ``t == version``; the last push of the step averages
  the sum (one preallocated buffer, one division), steps the optimizer and bumps the version, which
  releases the PULLs waiting for ``t + 1``. ``(rank, step)`` is applied at most once.
* A synchronous server must never hang on a dead worker: a rank that sends FAIL or drops its
  connection before FINISH fails every waiter at once (and is recorded in ``failures``); a rank
  that FINISHes fails the waiters that still need its gradient. Every wait has a deadline
  (``ps.timeout_s``) and the timeout text names the ranks that had not pushed.
* Reading the *next* request from an authenticated worker has no deadline on purpose: a worker may
  legitimately compute for a long time, and its liveness is judged by its peers' deadlines, by the
  kernel closing a dead process's socket, by TCP keepalive and by ``close()`` (which shuts sockets
  down and so wakes those reads). Handshakes and payloads of a started frame do have deadlines.
* One thread per connection; only that thread writes to its socket, so frames never interleave.
  Connections are capped so a flood of unauthenticated sockets cannot exhaust threads or memory.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipeline.errors import PSError, ProtocolError, WorkerFailure
from pipeline.ps.compression import Contribution, topk_count, wire_dtype
from pipeline.ps.modes import Consistency
from pipeline.ps.optim import FusedSGD, OptimizerSpec, build_optimizer
from pipeline.ps.protocol import (
    NONCE_SIZE,
    U32_MAX,
    Channel,
    DType,
    Header,
    MsgType,
    PeerClosedError,
    deadline_after,
    set_buffer_sizes,
    set_socket_options,
    verify_mac,
)

logger = logging.getLogger(__name__)

TIMEOUT_KEY = "ps.timeout_s"
HANDSHAKE_S = 10.0  # longest wait for a new connection's AUTH
_CLOSE_GRACE_S = 1.0  # how long close() lets woken waiters deliver their ERROR frames
_JOIN_DEADLINE_S = 2.0
_ACCEPT_POLL_S = 0.25
_MAX_ERROR_CHARS = 64 * 1024
_MAX_LOG_TAIL_CHARS = 256 * 1024


@dataclass(eq=False)
class _Conn:
    """Server-side state of one authenticated worker connection."""

    rank: int
    generation: int
    channel: Channel
    grad_buf: bytearray
    superseded: bool = False  # cut by new_generation(): its drop is not a worker failure
    pulled_version: int = 0  # version of the last PARAMS sent: the base of this rank's next gradient


@dataclass
class _Stats:
    bytes_received: int = 0
    bytes_sent: int = 0
    pushes_applied: int = 0
    # (rank, step) contributions actually applied, per rank: a step cut by new_generation() before every
    # rank pushed is discarded and redone by the next attempt, so it is counted there, once.
    steps_applied_by_rank: dict[int, int] = field(default_factory=dict)
    discarded_pushes: int = 0  # pushes of steps that a new generation cut before they were complete
    generations: int = 1
    rejected_connections: int = 0
    protocol_errors: int = 0
    last_step_by_rank: dict[int, int] = field(default_factory=dict)
    push_payload_bytes: int = 0  # tensor bytes of PUSH frames: what compression shrinks
    staleness_max: int = 0  # async: versions applied between a rank's pull and its push being applied
    staleness_sum: int = 0
    staleness_count: int = 0
    blocked_pulls: int = 0  # ssp: pulls that had to wait for the slowest rank
    pull_wait_s_by_rank: dict[int, float] = field(default_factory=dict)  # ssp: time blocked per rank


class _Refusal(Exception):
    """Internal: a request that is answered with an ERROR frame and the connection kept."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ShardAddress:
    """Where one shard listens and which slice ``[start, end)`` of the flat parameters it owns."""

    host: str
    port: int
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "start": self.start, "end": self.end}


# Called as sink(failure, consequence, generation) instead of recording locally; it records on every shard.
FailureSink = Callable[[WorkerFailure, bool, int], None]


class ShardServer:
    """One shard of the parameter server. Use as a context manager or call ``start()``/``close()``.

    Standing alone (the defaults) it is a complete one-shard server owning ``[0, N)``.
    """

    def __init__(
        self,
        initial: torch.Tensor,
        *,
        world_size: int,
        secret: bytes,
        optimizer: OptimizerSpec,
        host: str,
        port: int = 0,
        timeout_s: float = 60.0,
        generation: int = 1,
        on_metrics: Callable[[int, dict], None] | None = None,
        consistency: Consistency | None = None,
        compression: str = "none",
        topk_ratio: float = 0.01,
        shard_index: int = 0,
        start: int = 0,
        total_params: int | None = None,
        failure_sink: FailureSink | None = None,
    ) -> None:
        if not isinstance(initial, torch.Tensor) or initial.numel() == 0:
            raise PSError("the parameter server needs a non-empty initial parameter tensor")
        if not torch.isfinite(initial).all():
            raise PSError("the initial parameters contain NaN or Inf")
        if not 1 <= world_size <= U32_MAX:
            raise PSError(f"world_size must be >= 1, got {world_size}")
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise PSError("the PS secret must be at least 16 random bytes (use pipeline.ps.new_secret())")
        if not timeout_s > 0:
            raise PSError(f"{TIMEOUT_KEY} must be > 0, got {timeout_s}")
        if not 0 <= generation <= U32_MAX:
            raise PSError(f"generation must fit an unsigned 32-bit field, got {generation}")
        if not host:
            raise PSError("the PS needs an explicit host to bind (ps.host or spark.driver.host)")
        self._consistency = consistency or Consistency()
        self._compression = compression
        self._topk_ratio = float(topk_ratio)
        if compression == "topk":
            topk_count(1, self._topk_ratio)  # validates the ratio on the driver, before any worker runs
        self._push_dtypes = frozenset({wire_dtype(compression)})

        self._flat = initial.detach().to(device="cpu", dtype=torch.float32).reshape(-1).clone()
        self._flat.requires_grad_(True)
        self._num_params = self._flat.numel()  # this shard's slice
        self._shard_index = shard_index
        self._start = start
        self._total_params = self._num_params if total_params is None else total_params
        self._layout: list[ShardAddress] | None = None  # set by the facade, or at start() when alone
        self._failure_sink = failure_sink
        # flat.grad IS the accumulation buffer: pushes sum into it, the step divides it once.
        self._grad_sum = torch.zeros_like(self._flat, requires_grad=False)
        self._flat.grad = self._grad_sum
        self._optimizer_spec = optimizer
        self._optimizer = build_optimizer(optimizer, self._flat)
        self._fused_sgd = FusedSGD.for_optimizer(self._optimizer)
        # ssp: one gradient sum per clock that may be in flight (the ring's slot 0 is _grad_sum).
        self._clock_sums = [self._grad_sum] + [torch.zeros_like(self._grad_sum)
                                                for _ in range(self._consistency.staleness
                                                               if self._consistency.mode == "ssp" else 0)]
        # Receive buffer per connection: a top-k push may carry up to 8 bytes per parameter.
        self._push_buf_bytes = self._flat.numel() * (8 if compression == "topk" else 4)

        self._world_size = world_size
        self._secret = bytes(secret)
        self._host = host
        self._port = port
        self._timeout_s = float(timeout_s)
        self._generation = generation
        self._on_metrics = on_metrics
        self._max_connections = 2 * world_size + 8

        self._cond = threading.Condition(threading.Lock())
        self._version = 0
        self._pushed: set[int] = set()
        self._clock: dict[int, int] = {}  # ssp/async: steps pushed per rank in this generation
        self._clock_pushed: dict[int, set[int]] = {}  # ssp: clock -> ranks that pushed it
        self._waiting: dict[int, int] = {}  # ssp: rank -> clock it is blocked on (observability)
        self._conns: dict[int, _Conn] = {}
        self._failures: dict[int, WorkerFailure] = {}
        # Ranks whose failure only followed an earlier failure or abort (a dropped peer, not a cause).
        self._consequences: set[int] = set()
        self._finished: set[int] = set()
        self._registered: set[int] = set()  # ranks that completed the handshake in this generation
        self._abort_reason: str | None = None
        self._closed = False
        self._replying = 0  # requests woken by fail()/close() that still have to send their ERROR
        self._readers = 0  # PULLs sending straight from the parameter tensor
        self._stepping = False  # an optimizer step waits for readers; new readers wait for it
        self._stats = _Stats()

        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._threads: set[threading.Thread] = set()
        self._open_channels: set[Channel] = set()
        self._started = False
        self._address: tuple[str, int] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> ShardServer:
        """Bind ``host:port`` (port 0 = OS-chosen) and start the accept thread."""
        with self._cond:
            if self._started:
                raise PSError("the parameter server was already started")
            if self._closed:
                raise PSError("the parameter server is closed")
            self._started = True
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            listener = socket.create_server((self._host, self._port), family=family,
                                            backlog=128)
        except OSError as exc:
            raise PSError(
                f"parameter server could not bind {self._host}:{self._port}: {exc} "
                "(check ps.host / spark.driver.host)"
            ) from exc
        listener.settimeout(_ACCEPT_POLL_S)
        set_buffer_sizes(listener)  # inherited by accepted sockets, so it is in place from the SYN on
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self._address = (host, port)
        if self._layout is None:  # standalone: the only shard
            self._layout = [ShardAddress(host, port, self._start, self._start + self._num_params)]
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"ps-accept-{self._shard_index}")
        self._accept_thread.start()
        logger.info("parameter server shard %s listening on %s:%s (world_size=%s, params [%s, %s), "
                    "generation=%s)", self._shard_index, *self.address, self._world_size, self._start,
                    self._start + self._num_params, self._generation)
        return self

    def set_layout(self, layout: list[ShardAddress]) -> None:
        """The facade hands every shard the whole layout before any worker can connect."""
        mine = layout[self._shard_index]
        if (mine.start, mine.end) != (self._start, self._start + self._num_params):
            raise PSError(f"layout gives shard {self._shard_index} [{mine.start}, {mine.end}) but it owns "
                          f"[{self._start}, {self._start + self._num_params})")
        with self._cond:
            self._layout = list(layout)

    def __enter__(self) -> ShardServer:
        return self.start() if not self._started else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving. Idempotent. Waiters get an ERROR first, then every socket is shut down."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._abort_reason is None:
                self._abort_reason = "the parameter server is shutting down"
            self._cond.notify_all()
            grace = time.monotonic() + _CLOSE_GRACE_S
            while self._replying and (left := grace - time.monotonic()) > 0:
                self._cond.wait(left)
            channels = list(self._open_channels)
        if self._listener is not None:
            try:  # shutdown wakes the blocked accept at once on Linux; the poll timeout elsewhere
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for channel in channels:
            channel.close()
        deadline = time.monotonic() + _JOIN_DEADLINE_S
        threads = [t for t in [self._accept_thread, *list(self._threads)] if t is not None]
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive() and t is not threading.current_thread()]
        if stuck:
            logger.warning("parameter server threads still running after close: %s", stuck)
        logger.info("parameter server closed at version %s", self._version)

    def fail(self, reason: str) -> None:
        """Abort: every current and future waiter gets an ERROR frame carrying ``reason``."""
        with self._cond:
            if self._abort_reason is None:
                self._abort_reason = reason
            self._cond.notify_all()
        logger.warning("parameter server aborted: %s", reason)

    def new_generation(self, generation: int | None = None) -> int:
        """Start a new barrier attempt, keeping parameters, optimizer state and version.

        Old connections are cut (their gradients for the unfinished step are discarded, so each
        (rank, step) is still applied at most once), failures/finished ranks and a ``fail()`` abort
        are cleared. Returns the new generation (default: current + 1).
        """
        with self._cond:
            if self._closed:
                raise PSError("the parameter server is closed")
            new = self._generation + 1 if generation is None else generation
            if not 0 <= new <= U32_MAX or new == self._generation:
                raise PSError(f"new generation must differ from {self._generation} and fit u32, got {new}")
            self._generation = new
            old = list(self._conns.values())
            for conn in old:
                conn.superseded = True
            self._conns.clear()
            self._failures.clear()
            self._consequences.clear()
            self._finished.clear()
            self._registered.clear()
            self._stats.discarded_pushes += len(self._pushed) + sum(len(p) for p in self._clock_pushed.values())
            self._stats.generations += 1
            self._pushed.clear()
            if self._consistency.mode != "async":
                # ssp restarts every rank at the version; async pushes were applied one by one, so each
                # rank resumes at its own clock (its data position).
                self._clock.clear()
            self._clock_pushed.clear()
            for buf in self._clock_sums:
                buf.zero_()
            self._abort_reason = None
            self._cond.notify_all()
        for conn in old:
            conn.channel.close()
        logger.info("parameter server moved to generation %s at version %s", new, self._version)
        return new

    # -- read-only views ---------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise PSError("the parameter server is not started")
        return self._address

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    @property
    def generation(self) -> int:
        with self._cond:
            return self._generation

    @property
    def num_params(self) -> int:
        return self._num_params

    @property
    def consistency(self) -> Consistency:
        return self._consistency

    @property
    def waiting_ranks(self) -> dict[int, int]:
        """ssp: ranks blocked by the staleness bound now, with the clock each wants to start."""
        with self._cond:
            return dict(self._waiting)

    def parameters(self) -> torch.Tensor:
        """A copy of the flat fp32 parameters (consistent: taken under the step lock)."""
        with self._cond:
            return self._flat.detach().clone()

    @property
    def failures(self) -> dict[int, WorkerFailure]:
        with self._cond:
            return dict(self._failures)

    @property
    def root_failures(self) -> dict[int, WorkerFailure]:
        """Failures that were not just the fallout of an earlier one: what a report should name."""
        with self._cond:
            return {r: f for r, f in self._failures.items() if r not in self._consequences}

    @property
    def registered_ranks(self) -> set[int]:
        """Ranks that authenticated in this generation (connected now, finished or failed since)."""
        with self._cond:
            return set(self._registered)

    @property
    def aborted(self) -> bool:
        """Whether fail() was called or a rank failed: the current attempt cannot complete."""
        with self._cond:
            return self._abort_reason is not None or bool(self._failures)

    @property
    def finished_ranks(self) -> set[int]:
        with self._cond:
            return set(self._finished)

    @property
    def stats(self) -> dict[str, Any]:
        with self._cond:
            s = self._stats
            live = list(self._open_channels)  # closed channels were folded into _stats already
            return {
                "bytes_received": s.bytes_received + sum(c.bytes_received for c in live),
                "bytes_sent": s.bytes_sent + sum(c.bytes_sent for c in live),
                "pushes_applied": s.pushes_applied,
                "steps_applied_by_rank": dict(s.steps_applied_by_rank),
                "discarded_pushes": s.discarded_pushes,
                "generations": s.generations,
                "rejected_connections": s.rejected_connections,
                "protocol_errors": s.protocol_errors,
                "last_step_by_rank": dict(s.last_step_by_rank),
                "requests_in_flight": self._replying,  # PULL/PUSH being handled or waiting now
                "mode": self._consistency.mode,
                "compression": self._compression,
                "push_payload_bytes": s.push_payload_bytes,
                "staleness_max": s.staleness_max,
                "staleness_mean": s.staleness_sum / s.staleness_count if s.staleness_count else 0.0,
                "blocked_pulls": s.blocked_pulls,
                "pull_wait_s_by_rank": dict(s.pull_wait_s_by_rank),
                "clock_by_rank": dict(self._clock),
            }

    def state_dict(self) -> dict[str, Any]:
        """Parameters, optimizer state and version, for checkpoints (deep copies, plain types only,
        so checkpoints of it load with weights-only loading)."""
        with self._cond:
            return {
                "version": self._version,
                "params": self._flat.detach().clone(),
                "optimizer": copy.deepcopy(self._optimizer.state_dict()),
                "optimizer_spec": dataclasses.asdict(self._optimizer_spec),
                # async: each rank's next step (its data position); the counters prove at-most-once.
                "clocks": dict(self._clock) if self._consistency.mode == "async" else {},
                "steps_applied_by_rank": dict(self._stats.steps_applied_by_rank),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; refused while a step is half-pushed.

        The optimizer kind must match; its hyperparameters come from *this* server's spec (the
        current config wins over the checkpoint's lr/momentum/...), its state from the checkpoint.
        """
        params = state["params"]
        if not isinstance(params, torch.Tensor) or params.numel() != self._num_params:
            raise PSError(f"checkpoint parameters do not match the server's {self._num_params} parameters")
        saved_name = dict(state.get("optimizer_spec") or {}).get("name", self._optimizer_spec.name)
        if saved_name != self._optimizer_spec.name:
            raise PSError(f"checkpoint was trained with optimizer {saved_name!r} but train.optimizer is "
                          f"{self._optimizer_spec.name!r}; resume with the same optimizer")
        with self._cond:
            if self._pushed or self._clock_pushed:
                raise PSError(f"cannot load state while step {self._version} is partly pushed")
            with torch.no_grad():
                self._flat.copy_(params.reshape(-1).to(torch.float32))
            self._optimizer.load_state_dict(state["optimizer"])
            group = self._optimizer.param_groups[0]
            spec = self._optimizer_spec
            group.update(lr=spec.lr, weight_decay=spec.weight_decay)
            if spec.name == "sgd":
                group["momentum"] = spec.momentum
            else:
                group["betas"] = tuple(spec.betas)
            self._version = int(state["version"])
            if self._consistency.mode == "async":
                self._clock = {int(r): int(c) for r, c in dict(state.get("clocks") or {}).items()}
            self._stats.steps_applied_by_rank = {
                int(r): int(n) for r, n in dict(state.get("steps_applied_by_rank") or {}).items()}
            self._cond.notify_all()

    # -- accepting -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed or self._listener.fileno() < 0:
                    return
                # EMFILE, ECONNABORTED...: transient; keep serving the workers already connected.
                logger.warning("parameter server accept failed: %s; retrying", exc)
                time.sleep(0.05)
                continue
            with self._cond:
                if self._closed:
                    sock.close()
                    return
                too_many = len(self._threads) >= self._max_connections
                if too_many:
                    self._stats.rejected_connections += 1
                else:
                    thread = threading.Thread(target=self._serve_connection, args=(sock, peer),
                                              name=f"ps-conn-{peer[0]}:{peer[1]}", daemon=True)
                    self._threads.add(thread)
            if too_many:
                logger.warning("rejected connection from %s: more than %s open connections",
                               peer, self._max_connections)
                sock.close()
                continue
            thread.start()

    # -- per connection --------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket, peer: tuple) -> None:
        channel = Channel(sock, max_elements=0)
        with self._cond:
            self._open_channels.add(channel)
        conn: _Conn | None = None
        try:
            try:
                set_socket_options(sock)
            except OSError:
                pass  # the peer is already gone; the handshake below notices and logs it
            conn = self._handshake(channel, peer)
            if conn is not None:
                self._serve_rank(conn, peer)
        except Exception:  # a bug must not take the server down; log it with the peer
            logger.exception("parameter server connection handler for %s crashed", peer)
        finally:
            channel.close()
            with self._cond:
                self._open_channels.discard(channel)
                self._stats.bytes_received += channel.bytes_received
                self._stats.bytes_sent += channel.bytes_sent
                if conn is not None:
                    self._release_locked(conn)
                self._threads.discard(threading.current_thread())
                self._cond.notify_all()

    def _reject(self, channel: Channel, peer: tuple, reason: str, *, kind: str = "auth",
                generation: int = 0, rank: int = 0) -> None:
        """Drop an unauthenticated/malformed connection: log, count, best-effort ERROR frame."""
        logger.warning("rejected PS connection from %s: %s", peer, reason)
        with self._cond:
            self._stats.rejected_connections += 1
        self._send_error(channel, reason, kind=kind, generation=generation, rank=rank)

    def _send_error(self, channel: Channel, message: str, *, kind: str, generation: int,
                    rank: int, step: int = 0) -> None:
        try:
            channel.send_json(MsgType.ERROR, {"error": message[:_MAX_ERROR_CHARS], "kind": kind},
                              generation=generation, rank=rank, step=step, timeout=self._timeout_s)
        except (OSError, PSError):
            pass

    def _handshake(self, channel: Channel, peer: tuple) -> _Conn | None:
        """CHALLENGE -> AUTH -> WELCOME. Returns the registered connection, or None if rejected."""
        with self._cond:
            generation = self._generation
        nonce = secrets.token_bytes(NONCE_SIZE)
        # An honest worker answers CHALLENGE at once; unauthenticated sockets count against the connection
        # cap, so silent ones must not hold slots for the whole ps.timeout_s.
        handshake_s = min(self._timeout_s, HANDSHAKE_S)
        deadline = deadline_after(handshake_s)
        try:
            channel.send_bytes(MsgType.CHALLENGE, nonce, generation=generation, rank=0,
                               timeout=handshake_s)
            header = channel.recv_header(deadline)
            if header.type is not MsgType.AUTH:
                raise ProtocolError(f"expected AUTH, got {header.type.name}")
            mac = channel.recv_bytes(header, deadline)
        except TimeoutError:
            self._reject(channel, peer, f"no AUTH within {handshake_s:g}s of connecting")
            return None
        except (PSError, OSError) as exc:
            self._reject(channel, peer, f"handshake failed: {exc}")
            return None

        rank = header.rank
        if not verify_mac(self._secret, nonce, rank, header.generation, mac):
            self._reject(channel, peer, f"authentication failed for rank {rank}: wrong secret")
            return None
        with self._cond:
            reason = None
            if header.generation != self._generation:
                reason = (f"rank {rank} belongs to generation {header.generation} but the server is at "
                          f"generation {self._generation}; stale task from an earlier attempt")
            elif rank >= self._world_size:
                reason = f"rank {rank} is out of range for world_size {self._world_size}"
            elif self._abort_reason is not None:
                reason = self._abort_reason
            elif rank in self._finished or rank in self._failures:
                reason = (f"rank {rank} already {'finished' if rank in self._finished else 'failed'} "
                          f"in generation {self._generation}; one connection per rank per generation")
            elif rank in self._conns:
                reason = f"rank {rank} is already connected in generation {self._generation}"
            if reason is None:
                conn = _Conn(rank, self._generation, channel, bytearray(self._push_buf_bytes))
                self._conns[rank] = conn
                self._registered.add(rank)
                version = self._version
                # ssp clocks restart at the version (every earlier clock is applied); async at 0.
                clock = self._clock.setdefault(rank, version if self._consistency.mode == "ssp" else 0)
        if reason is not None:
            self._reject(channel, peer, reason, kind="error", generation=header.generation, rank=rank)
            return None
        channel.max_elements = self._num_params
        assert self._layout is not None
        welcome = {"num_params": self._total_params, "version": version, "shard": self._shard_index,
                   "shards": [a.to_dict() for a in self._layout],
                   "world_size": self._world_size, "generation": conn.generation,
                   "clock": clock, "compression": self._compression, "topk_ratio": self._topk_ratio,
                   **self._consistency.to_dict()}
        try:
            channel.send_json(MsgType.WELCOME, welcome, generation=conn.generation, rank=rank,
                              timeout=self._timeout_s)
        except (OSError, PSError) as exc:
            logger.warning("rank %s from %s vanished during the handshake: %s", rank, peer, exc)
        logger.info("rank %s connected from %s (generation %s)", rank, peer, conn.generation)
        return conn

    def _serve_rank(self, conn: _Conn, peer: tuple) -> None:
        """Request loop of one authenticated worker."""
        channel = conn.channel
        while True:
            try:
                # idle: no deadline, see module docstring
                header = channel.recv_header(None, tensor_dtypes=self._push_dtypes)
                if header.generation != conn.generation or header.rank != conn.rank:
                    raise ProtocolError(
                        f"frame for rank {header.rank} generation {header.generation} on the connection "
                        f"of rank {conn.rank} generation {conn.generation}"
                    )
                if self._dispatch(conn, header):
                    return
            except PeerClosedError:
                self._record_drop(conn, "closed its connection to the parameter server before FINISH")
                return
            except ProtocolError as exc:
                logger.warning("protocol error from rank %s (%s): %s", conn.rank, peer, exc)
                with self._cond:
                    self._stats.protocol_errors += 1
                self._send_error(channel, f"protocol error: {exc}", kind="protocol",
                                 generation=conn.generation, rank=conn.rank)
                self._record_drop(conn, f"sent a malformed frame and was disconnected: {exc}")
                return
            except TimeoutError:
                self._record_drop(conn, f"stalled mid-frame for more than {self._timeout_s:g}s "
                                        f"({TIMEOUT_KEY})")
                return
            except OSError as exc:
                self._record_drop(conn, f"lost its connection to the parameter server: {exc}")
                return

    def _dispatch(self, conn: _Conn, header: Header) -> bool:
        """Handle one request. Returns True when the connection is done (FINISH)."""
        channel = conn.channel
        kind = header.type
        if kind is MsgType.PUSH or kind is MsgType.PUSH_PULL:
            if header.dtype is not DType.SPARSE_F32 and header.count != self._num_params:
                raise ProtocolError(f"PUSH of {header.count} elements, the model has {self._num_params}")
            payload = channel.recv_into(header, conn.grad_buf, deadline_after(self._timeout_s))
            with self._cond:
                self._stats.push_payload_bytes += header.length
            contribution = Contribution(payload, header, self._num_params)  # validates sparse indices
            mode = self._consistency.mode
            if kind is MsgType.PUSH_PULL:
                self._reply_to(conn, header, lambda: self._handle_push_pull(conn, header.step, contribution))
                return False
            handler = (self._handle_push_async if mode == "async" else
                       self._handle_push_ssp if mode == "ssp" else self._handle_push)
            self._reply_to(conn, header, lambda: handler(conn, header.step, contribution))
            return False
        if kind is MsgType.PULL:
            pull = self._handle_pull_bounded if self._consistency.mode in ("ssp", "async") else self._handle_pull
            self._reply_to(conn, header, lambda: pull(conn, header.step))
            return False
        if kind is MsgType.METRICS:
            metrics = channel.recv_json(header, deadline_after(self._timeout_s))
            self._call_on_metrics(conn.rank, metrics)
            self._ack(conn, header.step)
            return False
        if kind is MsgType.FAIL:
            body = channel.recv_json(header, deadline_after(self._timeout_s))
            self._record_failure(conn, str(body.get("error", "worker reported a failure"))[:_MAX_ERROR_CHARS],
                                 str(body.get("log_tail", ""))[-_MAX_LOG_TAIL_CHARS:])
            self._ack(conn, header.step)
            return False
        if kind is MsgType.FINISH:
            with self._cond:
                if self._conns.get(conn.rank) is conn:
                    self._finished.add(conn.rank)
                    self._release_locked(conn)
                self._cond.notify_all()
            logger.info("rank %s finished at version %s", conn.rank, self.version)
            self._ack(conn, header.step)
            return True
        raise ProtocolError(f"unexpected {kind.name} frame from a worker")

    def _ack(self, conn: _Conn, step: int) -> None:
        conn.channel.send_empty(MsgType.ACK, generation=conn.generation, rank=conn.rank, step=step,
                                timeout=self._timeout_s)

    def _reply_to(self, conn: _Conn, header: Header, handler: Callable[[], None]) -> None:
        """Run a request handler; a refusal becomes an ERROR frame and the connection stays usable.
        ``_replying`` lets close() wait until woken waiters have delivered their ERROR."""
        with self._cond:
            self._replying += 1
        try:
            try:
                handler()
            except _Refusal as refusal:
                self._send_error(conn.channel, str(refusal), kind=refusal.kind,
                                 generation=conn.generation, rank=conn.rank, step=header.step)
        finally:
            with self._cond:
                self._replying -= 1
                self._cond.notify_all()

    # -- BSP core ----------------------------------------------------------------------------------
    def _refusal_locked(self, conn: _Conn) -> str | None:
        """Why no request of ``conn`` can be served now (abort, stale generation, failed peer)."""
        if self._abort_reason is not None:
            return self._abort_reason
        if conn.generation != self._generation or conn.superseded:
            return f"generation {conn.generation} was superseded by generation {self._generation}"
        if self._failures:
            parts = "; ".join(f"rank {r}: {f.error}" for r, f in sorted(self._failures.items()))
            ranks = ", ".join(str(r) for r in sorted(self._failures))
            if self._consistency.mode in ("sync", "average"):
                return (f"rank(s) {ranks} failed, so synchronous step {self._version} cannot complete "
                        f"({parts})")
            return f"rank(s) {ranks} failed, so the {self._consistency.mode} run cannot complete ({parts})"
        return None

    def _handle_push_pull(self, conn: _Conn, step: int, grad: Contribution) -> None:
        """PUSH(step) then PULL(step + 1) as one request: the reply is PARAMS (or one ERROR), no ACK."""
        mode = self._consistency.mode
        if mode == "async":
            raise _Refusal("PUSH_PULL is not available in async mode (the push's ACK carries the version it "
                           "was applied to); send PUSH then PULL")
        if mode == "ssp":
            self._handle_push_ssp(conn, step, grad, ack=False)
            self._handle_pull_bounded(conn, step + 1)
        else:
            self._handle_push(conn, step, grad, ack=False)
            self._handle_pull(conn, step + 1)

    def _handle_push(self, conn: _Conn, step: int, grad: Contribution, ack: bool = True) -> None:
        finite = grad.all_finite()  # outside the lock: a full pass over the gradient
        with self._cond:
            refusal = self._refusal_locked(conn)
            if refusal is not None:
                raise _Refusal(refusal)
            if step != self._version:
                raise _Refusal(f"rank {conn.rank} pushed a gradient for step {step} but the server is at "
                               f"version {self._version}; synchronous mode expects step == version")
            if conn.rank in self._pushed:
                raise _Refusal(f"rank {conn.rank} already pushed a gradient for step {step}")
            if not finite:
                raise _Refusal(f"rank {conn.rank} pushed a gradient with NaN/Inf for step {step}; "
                               "lower train.lr or check the loss")
            if self._pushed:
                grad.add_to(self._grad_sum)
            else:  # first push of the step: one pass that overwrites the (stale) sum
                grad.start_sum(self._grad_sum)
            self._pushed.add(conn.rank)
            self._stats.pushes_applied += 1
            self._stats.last_step_by_rank[conn.rank] = step
            if len(self._pushed) == self._world_size:
                self._apply_step_locked()
            self._cond.notify_all()
        if ack:
            self._ack(conn, step)

    def _apply_step_locked(self) -> None:
        """sync/average: apply the complete step and let the next one start. The sum is not zeroed
        afterwards: the next step's first push overwrites it (``Contribution.start_sum``)."""
        if self._step_locked(self._grad_sum, self._world_size, zero=False):
            applied = self._stats.steps_applied_by_rank
            for rank in self._pushed:
                applied[rank] = applied.get(rank, 0) + 1
            self._pushed.clear()

    def _step_locked(self, grad_sum: torch.Tensor, divisor: int, zero: bool = True) -> bool:
        """Apply one update from ``grad_sum`` (then zeroed) and bump the version; False if
        new_generation()/close() discarded it meanwhile.

        sync/ssp/async: ``flat.grad = grad_sum / divisor`` and one optimizer step. average: the sum
        holds parameter deltas, so ``flat += sum / divisor`` (no optimizer on the server).

        PARAMS are sent straight from the parameter tensor (no per-rank snapshot copy), so the step
        first waits for in-flight sends to finish; ``_stepping`` keeps new readers (and, in ssp/async,
        new pushes) out meanwhile. Each send has its own ``timeout_s``, which bounds this wait.
        """
        generation = self._generation
        self._stepping = True
        try:
            deadline = time.monotonic() + self._timeout_s + 1.0
            while self._readers and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._readers:  # pragma: no cover - a send outlived its own timeout
                logger.warning("stepping while %s parameter sends are still in flight", self._readers)
            if generation != self._generation or self._closed:
                return False
            if self._consistency.mode == "average":
                with torch.no_grad():
                    self._flat.add_(grad_sum, alpha=1.0 / divisor)
            else:
                if divisor != 1:
                    grad_sum.div_(divisor)
                self._flat.grad = grad_sum
                if self._fused_sgd is not None:
                    self._fused_sgd.step(self._flat.detach(), grad_sum)
                else:
                    self._optimizer.step()
            if zero:
                grad_sum.zero_()
            self._version += 1
            return True
        finally:
            self._stepping = False
            self._cond.notify_all()

    def _wait_not_stepping_locked(self, what: str) -> None:
        """ssp/async: a push must not touch the sums while an update is being applied."""
        deadline = time.monotonic() + self._timeout_s
        while self._stepping:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Refusal(f"timed out after {self._timeout_s:g}s waiting for the previous update to "
                               f"be applied before {what}; raise {TIMEOUT_KEY}", kind="timeout")
            self._cond.wait(left)

    def _check_clock_locked(self, conn: _Conn, step: int, finite: bool) -> None:
        """ssp/async: each rank pushes its steps in order, each at most once, and only finite values."""
        expected = self._clock.get(conn.rank, 0)
        if step != expected:
            raise _Refusal(f"rank {conn.rank} pushed step {step} but its next step is {expected}; in "
                           f"{self._consistency.mode} mode each rank pushes its steps once, in order")
        if not finite:
            raise _Refusal(f"rank {conn.rank} pushed a gradient with NaN/Inf for step {step}; "
                           "lower train.lr or check the loss")

    def _handle_push_async(self, conn: _Conn, step: int, grad: Contribution) -> None:
        """Apply at once as one optimizer step; the ACK's step is the version it was applied to."""
        finite = grad.all_finite()
        with self._cond:
            refusal = self._refusal_locked(conn)
            if refusal is not None:
                raise _Refusal(refusal)
            self._check_clock_locked(conn, step, finite)
            self._wait_not_stepping_locked(f"applying step {step} of rank {conn.rank}")
            base = self._version
            self._grad_sum.zero_()
            grad.add_to(self._grad_sum)
            if not self._step_locked(self._grad_sum, 1):
                raise _Refusal(f"generation {conn.generation} was superseded by generation {self._generation}")
            self._clock[conn.rank] = step + 1
            staleness = base - conn.pulled_version
            s = self._stats
            s.pushes_applied += 1
            s.steps_applied_by_rank[conn.rank] = s.steps_applied_by_rank.get(conn.rank, 0) + 1
            s.last_step_by_rank[conn.rank] = step
            s.staleness_max = max(s.staleness_max, staleness)
            s.staleness_sum += staleness
            s.staleness_count += 1
        self._ack(conn, base)

    def _handle_push_ssp(self, conn: _Conn, step: int, grad: Contribution, ack: bool = True) -> None:
        """Add to the clock's sum; apply every clock that is now complete, in order."""
        finite = grad.all_finite()
        bound = self._consistency.staleness
        with self._cond:
            refusal = self._refusal_locked(conn)
            if refusal is not None:
                raise _Refusal(refusal)
            self._check_clock_locked(conn, step, finite)
            if step - self._version > bound:
                raise _Refusal(f"rank {conn.rank} pushed clock {step} while the slowest rank is at clock "
                               f"{self._version}: more than ps.staleness={bound} ahead (PULL first)")
            self._wait_not_stepping_locked(f"adding clock {step} of rank {conn.rank}")
            grad.add_to(self._clock_sums[step % (bound + 1)])
            self._clock_pushed.setdefault(step, set()).add(conn.rank)
            self._clock[conn.rank] = step + 1
            self._stats.pushes_applied += 1
            self._stats.last_step_by_rank[conn.rank] = step
            while len(self._clock_pushed.get(self._version, ())) == self._world_size:
                clock = self._version
                if not self._step_locked(self._clock_sums[clock % (bound + 1)], self._world_size):
                    break
                del self._clock_pushed[clock]
            self._cond.notify_all()
        if ack:
            self._ack(conn, step)

    def _handle_pull_bounded(self, conn: _Conn, wanted: int) -> None:
        """ssp: PULL(c) = "rank wants to start clock c": wait until c - slowest <= staleness.
        async: PULL(v) waits until version >= v (workers ask for 0: never blocks)."""
        ssp = self._consistency.mode == "ssp"
        bound = self._consistency.staleness
        started = time.monotonic()
        deadline = started + self._timeout_s
        blocked = False
        with self._cond:
            try:
                while True:
                    refusal = self._refusal_locked(conn)
                    if refusal is not None:
                        raise _Refusal(refusal)
                    if ssp and self._clock.get(conn.rank, 0) < wanted:
                        raise _Refusal(f"rank {conn.rank} asked to start clock {wanted} but has pushed only "
                                       f"{self._clock.get(conn.rank, 0)} clocks; push before pulling")
                    ready = (wanted - self._version <= bound) if ssp else self._version >= wanted
                    if ready and not self._stepping:
                        break
                    if ssp and not self._stepping:
                        gone = sorted(r for r in self._finished if self._clock.get(r, 0) < wanted - bound)
                        if gone:
                            raise _Refusal(f"rank(s) {', '.join(map(str, gone))} finished behind clock "
                                           f"{wanted - bound}, so rank {conn.rank} can never start clock {wanted}")
                        blocked = True
                        self._waiting[conn.rank] = wanted
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise _Refusal(self._bounded_timeout_locked(conn.rank, wanted), kind="timeout")
                    self._cond.wait(left)
            finally:
                self._waiting.pop(conn.rank, None)
                if blocked:
                    self._stats.blocked_pulls += 1
                    waited = self._stats.pull_wait_s_by_rank
                    waited[conn.rank] = waited.get(conn.rank, 0.0) + time.monotonic() - started
            version = self._version
            conn.pulled_version = version
            self._readers += 1  # the next step waits until this send is done: no torn parameters
        self._send_params(conn, version)

    def _bounded_timeout_locked(self, rank: int, wanted: int) -> str:
        if self._consistency.mode != "ssp":
            return (f"timed out after {self._timeout_s:g}s waiting for version {wanted} (at {self._version}); "
                    f"raise {TIMEOUT_KEY}")
        bound = self._consistency.staleness
        slow = sorted(r for r in range(self._world_size) if self._clock.get(r, 0) <= self._version)
        return (f"timed out after {self._timeout_s:g}s waiting for the slowest rank(s) "
                f"{', '.join(map(str, slow))} (at clock {self._version}) so that rank {rank} may start clock "
                f"{wanted} within ps.staleness={bound}; raise {TIMEOUT_KEY} if these workers are only slow")

    def _send_params(self, conn: _Conn, version: int) -> None:
        """Send the parameters straight from the flat tensor; the caller registered a reader under the lock."""
        try:
            conn.channel.send_tensor(MsgType.PARAMS, self._flat.detach(), generation=conn.generation,
                                     rank=conn.rank, step=version, timeout=self._timeout_s)
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def _handle_pull(self, conn: _Conn, min_version: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            while True:
                refusal = self._refusal_locked(conn)
                if refusal is not None:
                    raise _Refusal(refusal)
                if self._version >= min_version and not self._stepping:
                    break
                if self._stepping:
                    pass  # the version is about to move; wait for it below
                elif min_version > self._version + 1 or conn.rank not in self._pushed:
                    raise _Refusal(
                        f"rank {conn.rank} asked for version {min_version} but the server is at version "
                        f"{self._version} and rank {conn.rank} has not pushed step {self._version}; "
                        "in synchronous mode a rank may only wait for the step it has pushed"
                    )
                gone = sorted(r for r in self._finished if r not in self._pushed)
                if gone:
                    raise _Refusal(
                        f"rank(s) {', '.join(map(str, gone))} finished without pushing step "
                        f"{self._version}, so version {min_version} can never be reached"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Refusal(self._timeout_message_locked(min_version), kind="timeout")
                self._cond.wait(left)
            version = self._version
            conn.pulled_version = version
            self._readers += 1  # the next step waits until this send is done: no torn parameters
        self._send_params(conn, version)

    def _timeout_message_locked(self, min_version: int) -> str:
        missing = sorted(set(range(self._world_size)) - self._pushed)
        never = [r for r in missing if r not in self._conns and r not in self._finished]
        text = (f"timed out after {self._timeout_s:g}s waiting for version {min_version}: "
                f"rank(s) {', '.join(map(str, missing))} had not pushed step {self._version}")
        if never:
            text += f" (rank(s) {', '.join(map(str, never))} never connected)"
        return text + f"; raise {TIMEOUT_KEY} if these workers are only slow"

    # -- failures ----------------------------------------------------------------------------------
    def _record_failure(self, conn: _Conn, error: str, log_tail: str = "", consequence: bool = False) -> None:
        with self._cond:
            if conn.superseded or self._closed or conn.generation != self._generation:
                return
            if conn.rank in self._failures or conn.rank in self._finished:
                return
        failure = WorkerFailure(conn.rank, error, log_tail)
        if self._failure_sink is not None:
            # Outside our lock: the sink takes every shard's lock in turn (never two at once).
            self._failure_sink(failure, consequence, conn.generation)
        else:
            self.mark_failure(failure, consequence, conn.generation)

    def mark_failure(self, failure: WorkerFailure, consequence: bool, generation: int) -> bool:
        """Record a rank's failure (from this shard or mirrored from another) and wake every waiter.
        First record per rank wins; False if the rank already failed/finished or the generation moved."""
        with self._cond:
            rank = failure.rank
            if self._closed or generation != self._generation:
                return False
            if rank in self._failures or rank in self._finished:
                return False
            self._failures[rank] = failure
            if consequence:
                self._consequences.add(rank)
            # Logged before anyone can see the failure, so the line never outlives what it reports
            # (a reader that returns on it may tear logging down next).
            logger.warning("rank %s failed (shard %s): %s", rank, self._shard_index, failure.error)
            self._cond.notify_all()
        return True

    def _record_drop(self, conn: _Conn, what: str) -> None:
        """A drop before FINISH is a failure; if peers had already failed it is marked as a likely
        consequence, so the report still points at the root cause."""
        with self._cond:
            last = self._stats.last_step_by_rank.get(conn.rank)
            earlier = sorted(r for r in self._failures if r != conn.rank)
            aborted = self._abort_reason
        text = f"rank {conn.rank} {what} (last pushed step: {last})"
        if earlier:
            text += f", after rank(s) {', '.join(map(str, earlier))} had failed"
        elif aborted:
            text += f", after the server aborted: {aborted}"
        self._record_failure(conn, text, consequence=bool(earlier or aborted))

    def _release_locked(self, conn: _Conn) -> None:
        if self._conns.get(conn.rank) is conn:
            del self._conns[conn.rank]

    def _call_on_metrics(self, rank: int, metrics: dict) -> None:
        if self._on_metrics is None:
            return
        try:
            self._on_metrics(rank, metrics)
        except Exception:  # a tracking hiccup must never break training
            logger.exception("on_metrics callback failed for rank %s", rank)


def _all_finite(t: torch.Tensor) -> bool:
    """Exact NaN/Inf check at the cost of a sum: NaN/Inf always propagate into the sum, and only
    an overflowing sum of finite values (vanishingly rare) pays for the elementwise check, which
    is ~10x slower than a sum on CPU."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())
