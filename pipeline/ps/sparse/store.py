"""The sparse tables of one parameter server and how their pushes become updates in each ``ps.mode``.

It lives beside shard 0's dense slice and shares that shard's condition: every method here is called
with it held, so a step's rows and its dense parameters change in one moment every reader sees whole.

* ``sync`` (and ``ssp``): a rank sends its SPARSE_PUSHes of step ``t`` before its dense PUSH of ``t`` on
  the same connection, so when the last dense push of ``t`` completes the step, every rank's rows are
  in. The dense update calls :meth:`on_update` (``ShardCore.after_update``): per table, the row
  gradients of every rank are summed per id, divided by the world size exactly like the dense sum, and
  applied once, before version ``t + 1`` (the PULLs of step ``t + 1``) is served. ssp weighs each
  push by the dense path's staleness rule (``staleness.weight`` of the clock minus the version the
  rank pulled) and applies a clock's rows with that clock's dense update.
* ``async``: each push is applied on arrival, weighted like the dense push (``staleness.weight`` of the
  versions applied since the rank pulled; SGD scales the gradient, Adagrad/Adam the step's rate, as
  ``staleness.scaled_step`` does).
* ``average`` has no gradients to push: tables are refused at construction.

Pending sums are keyed by (generation, step), so a push of an attempt that a new generation cut is
never applied: each (rank, table, step) counts at most once, like the dense (rank, step).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from pipeline.errors import ConfigError
from pipeline.ps.server.messages import Refusal
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.sparse.table import SparseTable, bad_ids
from pipeline.ps.modes.staleness import weight

logger = logging.getLogger(__name__)

_COUNTERS = ("pulls", "pushes", "rows_pulled", "rows_pushed", "bytes_received", "bytes_sent", "rejected_frames")


class SparseStore:
    def __init__(self, tables: list[SparseTable], consistency: Consistency, world_size: int, *,
                 wire_dtype: str = "fp32") -> None:
        if consistency.mode == "average":
            raise ConfigError("sparse embedding tables need gradients on the server: ps.mode=average cannot "
                              "train them (use sync, ssp or async, or raise ps.sparse.min_rows)")
        names = [t.spec.name for t in tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"sparse table names must be distinct, got {names}")
        self.tables = tables
        self.consistency = consistency
        self.world_size = world_size
        self.wire_dtype = wire_dtype
        self.pending: dict[tuple[int, int], dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.pushed: set[tuple[int, int, int, int]] = set()  # (generation, step, rank, table)
        self.counts = {key: 0 for key in _COUNTERS}
        self.core: Any = None
        self.policy: Any = None

    def attach(self, core: Any, policy: Any) -> None:
        """Bind to shard 0's core (its condition, version, generation) and its consistency policy."""
        self.core, self.policy = core, policy
        core.after_update = self.on_update

    def table(self, index: int) -> SparseTable:
        return self.tables[index]

    # -- requests (the core's condition held) --------------------------------------------------------
    def pull_locked(self, conn: Any, index: int, step: int, ids: np.ndarray) -> tuple[int, torch.Tensor]:
        """Rows of ``ids`` as of the current version (sync: a rank pulls step t once version t is served)."""
        core = self.core
        if self.consistency.mode == "sync" and step > core.version:
            raise Refusal(f"rank {conn.rank} asked for the rows of step {step} but the server is at version "
                          f"{core.version}; pull the dense parameters of that step first")
        rows = self.tables[index].lookup(ids, step)
        self.counts["pulls"] += 1
        self.counts["rows_pulled"] += len(ids)
        return core.version, rows

    def push_locked(self, conn: Any, index: int, step: int, ids: np.ndarray, grad: torch.Tensor) -> None:
        core, mode = self.core, self.consistency.mode
        key = (conn.generation, step, conn.rank, index)
        if key in self.pushed:
            raise Refusal(f"rank {conn.rank} already pushed the rows of table {self.tables[index].spec.name!r} "
                          f"for step {step}")
        if mode == "sync" and step != core.version:
            raise Refusal(f"rank {conn.rank} pushed rows for step {step} but the server is at version "
                          f"{core.version}; synchronous mode expects step == version")
        if mode in ("ssp", "async") and step != self.policy.clock.get(conn.rank, 0):
            raise Refusal(f"rank {conn.rank} pushed rows for step {step} but its next step is "
                          f"{self.policy.clock.get(conn.rank, 0)} (rows go before the step's dense push)")
        if not torch.isfinite(grad).all():
            raise Refusal(f"rank {conn.rank} pushed row gradients with NaN/Inf for step {step}; lower "
                          "ps.sparse.lr or check the loss", kind="nonfinite")
        self.counts["pushes"] += 1
        self.counts["rows_pushed"] += len(ids)
        if mode == "async":
            core.wait_not_stepping_locked(f"applying the rows of step {step} of rank {conn.rank}")
            self._apply(index, [(torch.from_numpy(ids), grad)], core.version, divisor=1,
                        scale=weight(self.consistency.staleness_scale, core.version - conn.pulled_version))
            return
        scale = 1.0
        if mode == "ssp":
            scale = weight(self.consistency.staleness_scale, step - conn.pulled_version)
        self.pushed.add(key)
        bucket = self.pending.setdefault((conn.generation, step), {}).setdefault(index, [])
        bucket.append((torch.from_numpy(ids), grad if scale == 1.0 else grad * scale))

    # -- updates -------------------------------------------------------------------------------------
    def on_update(self, version: int) -> None:
        """The dense update of ``version`` is being applied: apply the rows pushed for it (sync/ssp)."""
        generation = self.core.generation
        step = self.pending.pop((generation, version), None)
        for index, parts in (step or {}).items():
            self._apply(index, parts, version, divisor=self.world_size)
        stale = [k for k in self.pending if k[0] != generation or k[1] <= version]
        for k in stale:
            del self.pending[k]
        self.pushed = {k for k in self.pushed if k[0] == generation and k[1] > version}

    def _apply(self, index: int, parts: list[tuple[torch.Tensor, torch.Tensor]], step: int, *,
               divisor: int, scale: float = 1.0) -> None:
        table = self.tables[index]
        ids = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        grad = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1].clone()
        if len(parts) > 1:
            ids, inverse = torch.unique(ids, return_inverse=True)
            grad = torch.zeros(len(ids), table.spec.dim).index_add_(0, inverse, grad)
        if divisor != 1:
            grad.div_(divisor)
        lr_scale = 1.0
        if scale != 1.0:
            if table.optimizer.name == "sgd":
                grad.mul_(scale)
            else:
                lr_scale = scale
        table.apply(ids.numpy(), grad, step, lr_scale)

    # -- views and checkpoints -----------------------------------------------------------------------
    def check_ids(self, index: int, ids: np.ndarray) -> str | None:
        table = self.tables[index]
        return bad_ids(table.spec, ids) or table.foreign(ids)

    @property
    def parts(self) -> int:
        """How many server shards the tables' rows are spread over (announced in WELCOME)."""
        return self.tables[0].part[1] if self.tables else 1

    def stats_locked(self) -> dict[str, Any]:
        return {**self.counts, "tables": {t.spec.name: t.stats() for t in self.tables}}

    def state_locked(self) -> dict[str, Any]:
        """Every table's rows and row-wise state, per table per row shard (plain tensors and types)."""
        return {t.spec.name: t.state_dict() for t in self.tables}

    def restore_locked(self, state: dict[str, Any]) -> None:
        missing = [t.spec.name for t in self.tables if t.spec.name not in state]
        if missing:
            raise ConfigError(f"the checkpoint has no rows for sparse table(s) {missing}; it was written by a "
                              "different model (or without ps.sparse)")
        for t in self.tables:
            t.load_state_dict(state[t.spec.name])
        self.pending.clear()
        self.pushed.clear()
