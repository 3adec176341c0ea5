"""The driver's parameter server: a facade over ``ps.shards`` shard servers (``shard.ShardServer``).

Why shards: one server thread pool behind one lock serialises every update; K shards each own a
contiguous, balanced slice of the flat parameter vector, with their own listener, threads, lock,
optimizer and version counter, and a worker talks to all of them at once (one connection per
(worker, shard)). Because every supported optimizer is elementwise, stepping K slices is exactly
stepping the whole vector, so ``sync`` with K shards computes what one shard computes.

What is shared between shards, and why:

* The layout (each shard's address and ``[start, end)``) is announced in every shard's WELCOME, so
  a worker needs only the first shard's address (the one ``address`` returns); a shard could equally
  run on another host.
* Failures (``failures.FailureBoard``): a rank's failure seen by one shard is recorded on every shard
  with one verdict (root cause or consequence), so waiters on every shard are released at once.
* Lifecycle and aggregate views (``fanout.ServerGroup``, shared with ``StagedParameterServer``).

The public driver API (``address``, ``version``, ``parameters()``, ``failures``, ``root_failures``,
``registered_ranks``, ``aborted``, ``stats``, ``fail()``, ``close()``, ``state_dict()``...) is the
one of a single server; with ``shards=1`` every call is the one shard's own.

Known limit: a step is applied per shard, not atomically across shards; if a rank dies between its
pushes to two shards, the shards' versions can end one step apart (``new_generation`` refuses to
continue then in sync/average mode, rather than training on mixed parameters).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from pipeline.errors import PSError, WorkerFailure
from pipeline.ps.state.buffers import BufferStore
from pipeline.ps.transport.connection import ShardAddress
from pipeline.ps.server.failures import FailureBoard, FailureObserver
from pipeline.ps.server.fanout import MixedVersionsText, ServerGroup
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.settings import SHARDS_KEY, PSSettings
from pipeline.ps.server.shard import ShardServer
from pipeline.ps.sparse.parts import merge_stats, split_state
from pipeline.ps.state.sharded import merge_shard_states, slice_optimizer_state

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import ServerCert

logger = logging.getLogger(__name__)

# Modes whose version counts whole steps of every rank: shards must agree on it.
_LOCKSTEP_MODES = ("sync", "average")
# time_reduce_s/time_optimizer_s: every shard's work on a step (shards run concurrently: their sum is the
# server's CPU time per update, not its latency); timed_updates and the sync wait stay shard 0's.
_SUMMED_STATS = ("bytes_received", "bytes_sent", "push_payload_bytes", "rejected_connections",
                 "protocol_errors", "requests_in_flight", "blocked_pulls", "time_reduce_s", "time_optimizer_s")


def partition(num_params: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous ranges covering ``[0, num_params)`` whose sizes differ by at most one."""
    if not 1 <= shards <= num_params:
        raise PSError(f"{SHARDS_KEY} must be between 1 and the number of parameters ({num_params}), "
                      f"got {shards}")
    base, extra = divmod(num_params, shards)
    ranges, start = [], 0
    for i in range(shards):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class ParameterServer:
    """The parameter server of one run. Use as a context manager or call ``start()``/``close()``.

    ``on_failure(failure, consequence)`` observes each failed rank once, in arrival order, before any
    waiter is released; ``consequence``: the rank failed after another rank of this server had.
    """

    def __init__(self, initial: torch.Tensor, settings: PSSettings, *, world_size: int, secret: bytes,
                 host: str, port: int = 0, generation: int = 1,
                 on_metrics: Callable[[int, dict], None] | None = None,
                 on_failure: FailureObserver | None = None, buffers: BufferStore | None = None,
                 tls: ServerCert | None = None, sparse: Any = None, sparse_spec: Any = None,
                 spawn: Callable[..., Any] | None = None) -> None:
        if not isinstance(settings, PSSettings):
            raise PSError(f"ParameterServer needs PSSettings, got {type(settings).__name__}")
        if not isinstance(initial, torch.Tensor) or initial.numel() == 0:
            raise PSError("the parameter server needs a non-empty initial parameter tensor")
        flat = initial.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        self._ranges = partition(flat.numel(), settings.shards_for(flat.numel()))  # ps.bucket_mb slices
        self._num_params = flat.numel()
        self._settings = settings
        # The model's buffers live beside shard 0's parameters (pipeline.ps.state.buffers).
        self._buffers = buffers
        # ps.placement=hosts: spawn(init, **callbacks) gives shard i's proxy in a process on a worker host
        # (pipeline.ps.processes.remote_shard); else ps.server_processes' children on this host.
        processes = settings.server_processes or spawn is not None
        self._spawn = spawn
        if (processes and sparse is not None) or (sparse_spec is not None and spawn is None):
            # ``sparse``: shard 0's store, in this process. ``sparse_spec``: each shard process builds its part of
            # every table (rows hashed over the shards); only the hosts' shards do that today.
            raise PSError("sparse embedding tables (ps.sparse.min_rows) are served by in-process shards or by "
                          "ps.placement=hosts: set ps.server_processes=false, or ps.sparse.min_rows=0 to keep "
                          "every table dense")
        self._sparse_parts = len(self._ranges) if sparse_spec is not None else 0
        self._death: str | None = None
        # Shards in child processes always report failures to this process's board, which mirrors them.
        self._board = (FailureBoard(on_failure) if len(self._ranges) > 1 or on_failure is not None or processes
                       else None)
        member = dict(settings=settings, world_size=world_size, secret=secret, host=host, port=port,
                      on_metrics=on_metrics, tls=tls, flat=flat)
        if sparse_spec is not None:
            member.update(sparse=sparse_spec, sparse_parts=self._sparse_parts)
        if processes:
            from pipeline.ps.processes.shard_proxy import BuffersInChild

            member["buffers"], self._buffers = buffers, (
                None if buffers is None else BuffersInChild(buffers, lambda: self._shards[0]))
            self._member = lambda i, gen: self._shard_process(i, gen, **member)
        else:
            self._member = lambda i, gen: self._shard_thread(i, gen, buffers=buffers, sparse=sparse, **member)
        self._shards: list[Any] = []
        try:
            for i in range(len(self._ranges)):
                self._shards.append(self._member(i, generation))
        except BaseException:
            for shard in self._shards:  # children already spawned are reaped
                shard.close()
            raise
        if self._board is not None:
            self._board.attach(self._shards)
        self._group = ServerGroup(self._shards, name="shards", mixed=MixedVersionsText(
            "shards", " (a rank died between its pushes)", f"{SHARDS_KEY}=1 avoids this"))
        self._started = False

    def _shard_thread(self, i: int, generation: int, *, flat: torch.Tensor, port: int, on_metrics: Any,
                      buffers: BufferStore | None, sparse: Any, **common: Any) -> ShardServer:
        start, end = self._ranges[i]
        # Metrics are sent once per report, to shard 0 (and the model's buffers and sparse tables live beside it).
        return ShardServer(flat[start:end], port=port if i == 0 else 0, generation=generation,
                           on_metrics=on_metrics if i == 0 else None, shard_index=i, start=start,
                           total_params=self._num_params, failure_sink=self._board,
                           buffers=buffers if i == 0 else None, sparse=sparse if i == 0 else None, **common)

    def _shard_process(self, i: int, generation: int, *, flat: torch.Tensor, port: int, on_metrics: Any,
                       buffers: BufferStore | None, **common: Any) -> Any:
        from pipeline.ps.state.buffers import BufferSpec
        from pipeline.ps.processes.shard_init import ShardInit
        start, end = self._ranges[i]
        spec = BufferSpec(buffers.start()) if i == 0 and buffers is not None else None
        init = ShardInit("dense", flat[start:end].clone(), port=port if i == 0 else 0, generation=generation,
                         shard_index=i, start=start, total_params=self._num_params, buffers=spec, report_failures=True,
                         forward_metrics=i == 0 and on_metrics is not None, **common)  # sparse, sparse_parts
        if self._spawn is None:
            from pipeline.ps.processes.shard_proxy import ShardProcess as spawn
        else:
            spawn = self._spawn
        return spawn(init, failure_sink=self._board, on_metrics=on_metrics if i == 0 else None,
                     on_death=self._shard_died, on_buffers=None if spec is None else self._buffers.report)

    def _shard_died(self, text: str) -> None:
        """A shard process died: every other shard fails its waiters with the one text naming it."""
        if self._death is None:
            self._death = text
        self.fail(text)

    @property
    def failure_cause(self) -> str | None:
        """ps.server_processes: the first shard process death of this generation (the attempt's cause)."""
        return self._death

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> ParameterServer:
        """Bind every shard (OS-chosen ports except shard 0's ``port``), then announce the layout."""
        self._started = True
        self._group.start()
        self._announce_layout()
        return self

    def _announce_layout(self) -> None:
        if len(self._shards) > 1:
            # No worker knows any address before start() returns, so every WELCOME has the layout.
            layout = self.shards
            for shard in self._shards:
                shard.set_layout(layout)
            logger.info("parameter server: %s shards %s", len(layout),
                        ", ".join(f"{a.host}:{a.port}[{a.start},{a.end})" for a in layout))

    def revive(self) -> list[int]:
        """ps.server_processes: replace each dead shard process by a fresh one (at this generation, its
        state to be loaded from a checkpoint), announce the new layout; returns the revived indices."""
        dead = [i for i, s in enumerate(self._shards) if getattr(s, "dead", False)]
        if not dead:
            return []
        generation = self.generation
        for i in dead:
            self._shards[i].close()  # reaps the dead child
            self._shards[i] = self._member(i, generation)
            self._group.members[i] = self._shards[i]
            self._shards[i].start()
        if self._board is not None:
            self._board.attach(self._shards)
        self._announce_layout()
        logger.warning("parameter server: revived shard process(es) %s", dead)
        return dead

    def server_cpu_seconds(self) -> float:
        """CPU seconds the server used so far: its shard processes' own (ps.server_processes), else this
        whole process's (the shards are threads of it)."""
        if self._settings.server_processes or self._spawn is not None:
            return sum(s.cpu_seconds() for s in self._shards)
        import time

        return time.process_time()

    def __enter__(self) -> ParameterServer:
        return self if self._started else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving (every shard; idempotent)."""
        self._group.close()

    def fail(self, reason: str) -> None:
        """Abort: every current and future waiter on every shard gets an ERROR carrying ``reason``."""
        self._group.fail(reason)

    def new_generation(self, generation: int | None = None) -> int:
        """Start a new barrier attempt on every shard (see ``ShardServer.new_generation``)."""
        new = self._group.new_generation(
            generation, refuse_mixed_versions=self.consistency.mode in _LOCKSTEP_MODES)
        if self._board is not None:
            self._board.reset()
        if self._buffers is not None:
            self._buffers.fold()
        self._death = None
        return new

    # -- read-only views ---------------------------------------------------------------------------
    @property
    def shards(self) -> list[ShardAddress]:
        """Every shard's address and ``[start, end)`` range."""
        return [ShardAddress(*s.address, start, end) for s, (start, end) in zip(self._shards, self._ranges)]

    @property
    def members(self) -> list[Any]:
        """The shard servers (or their proxies), in slice order."""
        return list(self._shards)

    @property
    def address(self) -> tuple[str, int]:
        """Shard 0's address: the one workers are given; its WELCOME names the others."""
        return self._shards[0].address

    @property
    def version(self) -> int:
        """The version every shard has reached (the minimum over shards)."""
        return self._group.version

    @property
    def generation(self) -> int:
        return self._group.generation

    @property
    def num_params(self) -> int:
        return self._num_params

    @property
    def settings(self) -> PSSettings:
        return self._settings

    @property
    def consistency(self) -> Consistency:
        return self._settings.consistency

    @property
    def waiting_ranks(self) -> dict[int, int]:
        merged: dict[int, int] = {}
        for shard in self._shards:
            for rank, clock in shard.waiting_ranks.items():
                merged[rank] = max(clock, merged.get(rank, clock))
        return merged

    def parameters(self) -> torch.Tensor:
        """A copy of the flat fp32 parameters (each shard's slice taken under its step lock)."""
        if len(self._shards) == 1:
            return self._shards[0].parameters()
        return torch.cat([s.parameters() for s in self._shards])

    def buffers(self) -> torch.Tensor:
        """The merged model buffers as fp32 words (``pipeline.models.state``; empty: the model has none)."""
        if self._buffers is None:
            return torch.empty(0, dtype=torch.float32)
        return self._buffers.merged()

    @property
    def failures(self) -> dict[int, WorkerFailure]:
        return self._group.failures

    @property
    def root_failures(self) -> dict[int, WorkerFailure]:
        # The FailureBoard mirrors every failure, with one verdict, to every shard: shard 0 has them all.
        return self._shards[0].root_failures

    @property
    def silences(self) -> dict[int, tuple[float, str]]:
        """{rank: (seconds since it was last heard, host)} of the ranks connected now."""
        return self._group.silences

    @property
    def registered_ranks(self) -> set[int]:
        """Ranks that authenticated with any shard in this generation."""
        return self._group.registered_ranks

    @property
    def aborted(self) -> bool:
        return self._group.aborted

    @property
    def finished_ranks(self) -> set[int]:
        """Ranks that finished with every shard."""
        return self._group.finished_ranks

    @property
    def stats(self) -> dict[str, Any]:
        """Shard 0's counters of logical events (pushes, steps, staleness) with bytes summed over shards;
        ``by_shard`` has each shard's own stats."""
        per = [s.stats for s in self._shards]
        if len(per) == 1:
            return {**per[0], "shards": 1}
        parts = [p["sparse"] for p in per if "sparse" in p]  # shard 0's tables, or every shard's part of them
        sparse = {"sparse": merge_stats(parts)} if parts else {}
        return {**self._group.summed_stats(per, _SUMMED_STATS), "shards": len(per), "by_shard": per, **sparse}

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Parameters, optimizer state and version. With K shards, per-parameter optimizer tensors are
        concatenated in parameter order, so a checkpoint does not depend on ``ps.shards``.

        Shards step independently, so in sync/average mode a snapshot is retaken until every shard is
        at the same version (a step half-applied across shards is not a state any run had)."""
        states = self._group.consistent_states(lambda s: s.state_dict(), timeout_s,
                                               must_agree=self.consistency.mode in _LOCKSTEP_MODES)
        buffers = {} if self._buffers is None else {"buffers": self._buffers.merged()}
        return {**merge_shard_states(states), **buffers}

    def write_parts(self, directory: str, token: str, timeout_s: float) -> dict[str, Any]:
        """ps.placement=hosts: every shard writes its state to ``<directory>/<token>-shard-<i>-of-<K>.pt``
        itself; returns the checkpoint's ``ps`` record naming the parts and their digests (no parameter
        bytes come to this process). Retaken, like ``state_dict``, until every shard is at one version."""
        index = {id(s): i for i, s in enumerate(self._shards)}
        count = len(self._shards)
        written = self._group.consistent_states(
            lambda s: s.write_part(directory, f"{token}-shard-{index[id(s)]}-of-{count}.pt", timeout=timeout_s),
            timeout_s, must_agree=self.consistency.mode in _LOCKSTEP_MODES)
        first = written[0]
        buffers = {} if self._buffers is None else {"buffers": self._buffers.merged()}
        return {**buffers, "version": min(p["version"] for p in written), "clocks": first["clocks"],
                "steps_applied_by_rank": first["steps_applied_by_rank"], "optimizer_spec": first["optimizer_spec"],
                "parts": [{k: p[k] for k in ("file", "digest", "bytes", "version")} for p in written]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.revive():
            # The surviving shards may hold pushes of the step the dead one cut; a new generation drops them.
            self._group.new_generation(None, refuse_mixed_versions=False)
        if self._buffers is not None and state.get("buffers") is not None:
            # A checkpoint from before buffers were state has none: the workers keep their initial ones.
            self._buffers.restore(state["buffers"])
        if len(self._shards) == 1:
            self._shards[0].load_state_dict(state)
            return
        params = state["params"]
        if not isinstance(params, torch.Tensor) or params.numel() != self._num_params:
            raise PSError(f"checkpoint parameters do not match the server's {self._num_params} parameters")
        flat = params.reshape(-1)
        tables = state.get("sparse")
        # Spread tables: each shard gets only the rows it owns; else the tables go to shard 0, whole.
        parts = split_state(tables, self._sparse_parts) if tables is not None and self._sparse_parts else None
        for i, (shard, (start, end)) in enumerate(zip(self._shards, self._ranges)):
            shard.load_state_dict({**state, "params": flat[start:end],
                                   "optimizer": slice_optimizer_state(state["optimizer"], self._num_params,
                                                                       start, end),
                                   **({"sparse": parts[i]} if parts is not None else {})})
