"""What a server shard builds its sparse tables from, as plain values (``SparseSpec``).

Why a spec and not the store: with ``ps.placement: hosts`` each worker host's shard process builds its own
part of every table, so what crosses to it must be data (``pipeline.ps.processes.codec`` rebuilds these
dataclasses from their fields); the driver-hosted server builds the one store of its shard 0 from the same
spec. Rows are spread over the parts by ``pipeline.ps.sparse.table.owner_of`` (``pipeline.ps.sparse.parts``
merges and splits the parts' states).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.ps.sparse.rowopt import RowOptimizerSpec
from pipeline.ps.sparse.table import RowPolicy, TableSpec


UNBOUNDED_ROWS = 1 << 22


@dataclass(frozen=True)
class SparseSpec:
    """Every sparse table of a run and how the server trains them (``ps.sparse``)."""

    tables: tuple[TableSpec, ...]  # in the model's order (the frames' table index)
    optimizer: RowOptimizerSpec
    row_shards: int = 1
    policy: RowPolicy = RowPolicy()
    wire_dtype: str = "fp32"

    def build(self, consistency: Any, world_size: int, part: tuple[int, int] = (0, 1)) -> Any:
        """The ``SparseStore`` of server shard ``part[0]`` of ``part[1]`` (its rows only)."""
        from pipeline.ps.sparse.store import SparseStore
        from pipeline.ps.sparse.table import SparseTable

        tables = [SparseTable(t, self.optimizer, shards=self.row_shards, policy=self.policy, part=part)
                  for t in self.tables]
        return SparseStore(tables, consistency, world_size, wire_dtype=self.wire_dtype)

    def max_state_bytes(self) -> int:
        """An upper bound of the tables' state in bytes (what a shard's control message may have to carry).
        A table of hashed ids without ``ps.sparse.max_rows`` has no bound of its own: it counts as
        ``UNBOUNDED_ROWS`` rows here."""
        words = {"sgd": 0, "adagrad": 1, "adam": 2}[self.optimizer.name]
        total = 0
        for table in self.tables:
            rows = table.num_rows or self.policy.max_rows or UNBOUNDED_ROWS
            total += rows * (4 * table.dim * (1 + words) + 8 * 4)  # rows, state; id, last seen, adam step, slack
        return total
