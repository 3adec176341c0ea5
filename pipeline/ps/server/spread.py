"""The parameter server of ``ps.placement: hosts``: one shard per worker host, the driver as coordinator.

Why a facade of its own around ``ParameterServer``: the shards live in processes the barrier tasks start
(``pipeline.ps.processes.host_shard``), so they exist only while an attempt runs, and the number of hosts
can change between attempts (``train.min_workers``). The run's state therefore lives here between
attempts, in the shard-count-independent form of ``ParameterServer.state_dict``:

* ``attach(children, generation)`` builds the attempt's ``ParameterServer`` over the hosts' processes
  (K = the hosts; each serves the slice ``partition(M, K)`` gives it), loads the kept state into it, and
  tells each shard it is ready;
* ``detach()`` takes the state back (when every shard is at one version: a lost host leaves none, and the
  retry starts from the newest checkpoint set) and closes the shards, which ends their processes.

While attached every call goes to the attempt's server: the driver keeps the roster, the failure board,
METRICS, checkpoints and the final merge, and moves no parameter bytes but those. Detached, the views
answer from the kept state.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from pipeline.errors import PSError, WorkerFailure
from pipeline.ps.settings import PSSettings

if TYPE_CHECKING:
    from pipeline.ps.processes.registry import HostChild
    from pipeline.ps.server.parameter_server import ParameterServer
    from pipeline.ps.sparse.spec import SparseSpec
    from pipeline.ps.state.buffers import BufferStore
    from pipeline.wire.tls import ServerCert

logger = logging.getLogger(__name__)

# A failed attempt's shards are asked for their state this long (nothing pushes any more: a consistent
# state is there at once, or not at all).
DETACH_STATE_S = 2.0


class SpreadServer:
    """The run's parameter server whose shards are attached per attempt (see the module docstring)."""

    def __init__(self, initial: torch.Tensor, settings: PSSettings, *, world_size: int, secret: bytes,
                 on_metrics: Callable[[int, dict], None] | None = None, buffers: "BufferStore | None" = None,
                 tls: "ServerCert | None" = None, sparse: "SparseSpec | None" = None) -> None:
        self._initial = initial.detach().to(device="cpu", dtype=torch.float32).reshape(-1).clone()
        self._settings = settings
        self._world_size = world_size
        self._secret = secret
        self._on_metrics = on_metrics
        self._buffer_store = buffers
        self._tls = tls
        self._sparse = sparse  # each host's shard keeps its part of every sparse table (rows hashed by id)
        self._lock = threading.RLock()
        self._detaching = threading.Lock()
        self._abandoned: set[int] = set()  # generations whose attempt ended: a late attach must not commit
        self._inner: Optional["ParameterServer"] = None
        self._state: Optional[dict] = None  # the kept state; None: the initial parameters, no optimizer state
        self._lost = False  # the last attempt left no consistent state: load a checkpoint before the next
        self._generation = 1
        self._last: dict[str, Any] = {"stats": {}, "failures": {}, "root_failures": {}, "finished_ranks": set(),
                                      "failure_cause": None, "aborted": False}
        self.hosts: list[str] = []  # the last attempt's shard hosts, in shard order

    # -- attempts ------------------------------------------------------------------------------------
    def attach(self, children: list["HostChild"], generation: int) -> None:
        """The attempt's server over ``children`` (one per host, in host order), at ``generation``."""
        from pipeline.ps.processes.remote_shard import RemoteShard
        from pipeline.ps.server.parameter_server import ParameterServer

        with self._lock:
            if self._inner is not None:
                raise PSError("the parameter server's shards are attached already")
            if self._lost:
                raise PSError("the last attempt's shards left no consistent state; load a checkpoint first")
            state = self._state
        by_index = {c.index: c for c in children}

        def spawn(init, **callbacks):
            child = by_index[init.shard_index]
            return RemoteShard(dataclasses.replace(init, host=child.host), child, **callbacks)

        settings = dataclasses.replace(self._settings, shards=len(children), bucket_bytes=0, server_processes=False)
        server = ParameterServer(state["params"] if state is not None else self._initial, settings,
                                 world_size=self._world_size, secret=self._secret, host=children[0].host,
                                 generation=generation, on_metrics=self._on_metrics, buffers=self._buffer_store,
                                 tls=self._tls, sparse_spec=self._sparse, spawn=spawn)
        try:
            server.start()
            if state is not None:
                server.load_state_dict(state)
            for shard in server.members:
                shard.ready()
        except BaseException:
            server.close()
            raise
        with self._lock:
            if generation in self._abandoned:  # the attempt ended while its shards were being set up
                server.close()
                raise PSError(f"attempt generation {generation} ended before its shards were set up")
            self._inner, self._generation = server, generation
            self.hosts = [c.host for c in children]
            logger.info("parameter server spread over %d host(s): %s", len(children),
                        ", ".join(f"shard {a.start}..{a.end} on {a.host}:{a.port}" for a in server.shards))

    def detach(self) -> bool:
        """Take the state back from the attempt's shards and close them; True when it was consistent."""
        with self._detaching:  # one detach at a time; the views keep answering from the shards meanwhile
            inner = self._inner
            if inner is None:
                return not self._lost
            state, why = None, ""
            try:
                state = inner.state_dict(timeout_s=DETACH_STATE_S)  # the merged buffers included
            except PSError as exc:
                why = str(exc)
            # A failed attempt stays aborted until the next attaches: the stage watchdog's grace then ends a
            # barrier job whose cut-off tasks never return.
            last = {"stats": dict(inner.stats), "failures": dict(inner.failures), "aborted": inner.aborted,
                    "root_failures": dict(inner.root_failures), "finished_ranks": set(inner.finished_ranks),
                    "failure_cause": inner.failure_cause}
            with self._lock:  # the state and the views switch over together
                self._inner, self._last = None, last
                if state is not None:
                    self._state, self._lost = state, False
                else:
                    self._lost = True
            inner.close()
        if state is None:
            logger.warning("the parameter server's shards left no consistent state (%s); the retry starts them "
                           "from the newest checkpoint", why)
        return state is not None

    def abandon(self, generation: int) -> None:
        """The attempt of ``generation`` ended: an attach of it still under way closes its shards instead
        of committing (it would bring back that generation after the retry moved on)."""
        with self._lock:
            self._abandoned.add(generation)

    @property
    def attached(self) -> bool:
        return self._inner is not None

    @property
    def lost(self) -> bool:
        """The last attempt's shards left no consistent state (a shard or its host was lost)."""
        return self._lost

    def __enter__(self) -> "SpreadServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()

    # -- the driver's API (ParameterServer's), attached or not -----------------------------------------
    def fail(self, reason: str) -> None:
        inner = self._inner
        if inner is not None:
            inner.fail(reason)

    def new_generation(self, generation: int | None = None) -> int:
        if self._inner is not None:
            raise PSError("a new generation starts with the next attempt's shards (detach first)")
        self._generation = generation if generation is not None else self._generation + 1
        self._last["aborted"] = False  # the next attempt starts clean
        return self._generation

    def state_dict(self, timeout_s: float = 10.0) -> dict[str, Any]:
        with self._lock:  # attached or not, as one moment (detach switches both under it)
            inner, lost, state = self._inner, self._lost, self._state
        if inner is not None:
            return inner.state_dict(timeout_s)
        if lost:
            raise PSError("the last attempt's shards left no consistent state (a host or a shard was lost)")
        if state is None:
            return {"version": 0, "params": self._initial.clone(), **self._initial_buffers()}
        return state

    def write_parts(self, directory: str, token: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Attached: each host's shard writes its part of a checkpoint set (``ParameterServer.write_parts``);
        detached: the kept state itself (nothing runs that could write a part, and the driver holds it)."""
        with self._lock:
            inner = self._inner
        if inner is not None:
            return inner.write_parts(directory, token, timeout_s)
        return self.state_dict(timeout_s)

    def _initial_buffers(self) -> dict:
        return {} if self._buffer_store is None else {"buffers": self._buffer_store.merged()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._inner is not None:
            raise PSError("load a state between attempts, not into the running shards")
        params = state.get("params")
        if not isinstance(params, torch.Tensor) or params.numel() != self._initial.numel():
            raise PSError(f"checkpoint parameters do not match the server's {self._initial.numel()} parameters")
        if self._buffer_store is not None and state.get("buffers") is not None:
            self._buffer_store.restore(state["buffers"])
        self._state, self._lost = state, False

    def parameters(self) -> torch.Tensor:
        inner = self._inner
        return inner.parameters() if inner is not None else self.state_dict()["params"].clone()

    def buffers(self) -> torch.Tensor:
        inner = self._inner
        if inner is not None:
            return inner.buffers()
        if self._buffer_store is None:
            return torch.empty(0, dtype=torch.float32)
        return self._buffer_store.merged()

    @property
    def version(self) -> int:
        with self._lock:
            inner, state = self._inner, self._state
        if inner is not None:
            return inner.version
        return int(state["version"]) if state is not None else 0

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def consistency(self):
        return self._settings.consistency

    @property
    def settings(self) -> PSSettings:
        return self._settings

    @property
    def num_params(self) -> int:
        return self._initial.numel()

    @property
    def address(self) -> tuple[str, int]:
        inner = self._inner
        if inner is None:
            raise PSError("ps.placement=hosts: the shards exist only while an attempt runs")
        return inner.address

    @property
    def shards(self) -> list:
        inner = self._inner
        return inner.shards if inner is not None else []

    def _view(self, name: str, detached: Any) -> Any:
        inner = self._inner
        return getattr(inner, name) if inner is not None else detached

    @property
    def aborted(self) -> bool:
        return self._view("aborted", self._last["aborted"])

    @property
    def registered_ranks(self) -> set[int]:
        return self._view("registered_ranks", set())

    @property
    def finished_ranks(self) -> set[int]:
        return self._view("finished_ranks", self._last["finished_ranks"])

    @property
    def failures(self) -> dict[int, WorkerFailure]:
        return self._view("failures", self._last["failures"])

    @property
    def root_failures(self) -> dict[int, WorkerFailure]:
        return self._view("root_failures", self._last["root_failures"])

    @property
    def silences(self) -> dict:
        return self._view("silences", {})

    @property
    def waiting_ranks(self) -> dict[int, int]:
        return self._view("waiting_ranks", {})

    @property
    def failure_cause(self) -> str | None:
        return self._view("failure_cause", self._last["failure_cause"])

    @property
    def stats(self) -> dict[str, Any]:
        inner = self._inner
        return dict(inner.stats) if inner is not None else dict(self._last["stats"])

