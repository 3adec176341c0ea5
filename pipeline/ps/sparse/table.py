"""A sparse embedding table on the parameter server: ``dim``-wide fp32 rows spread over K row shards by
``mix64(id) % K``, created on first touch at a value seeded by (table, id), each shard with its own
row-wise optimizer state (``rows.RowShard``).

A table may be one *part* of a table spread over S server shards (``ps.placement: hosts``): part ``p``
holds the ids with ``mix64(id) % S == p`` (``owner_of``), refuses others, and keeps only its own rows when
a whole table's state is loaded into it (``pipeline.ps.sparse.parts`` merges and splits the parts' states).

Ids are int64. A bounded table (``num_rows`` > 0: a categorical feature's vocabulary or hash buckets)
refuses ids outside ``[0, num_rows)``; an unbounded one (``num_rows`` 0: hashed ids) takes any id >= 0.
Memory is what was touched, never what was declared.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from pipeline.errors import ConfigError
from pipeline.ps.sparse.hashing import init_rows, shard_of, table_seed
from pipeline.ps.sparse.rows import RowShard
from pipeline.ps.sparse.rowopt import RowOptimizerSpec

MAX_DIM = 4096


@dataclass(frozen=True)
class TableSpec:
    """One table (plain values: the same spec builds the worker's module and the server's table)."""

    name: str
    dim: int
    num_rows: int = 0  # 0: unbounded (hashed ids)
    init_std: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.dim <= MAX_DIM:
            raise ConfigError(f"sparse table {self.name!r}: dim must be in [1, {MAX_DIM}], got {self.dim}")
        if self.num_rows < 0:
            raise ConfigError(f"sparse table {self.name!r}: num_rows must be >= 0 (0: unbounded), got {self.num_rows}")

    @property
    def hash_seed(self) -> int:
        return table_seed(self.name, self.seed)

    def initial_rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows a table starts from (what an unknown or not yet admitted id reads as)."""
        return init_rows(self.hash_seed, ids, self.dim, self.init_std)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RowPolicy:
    """Admission and eviction of one table (``ps.sparse.*``)."""

    admit_after: int = 1
    ttl_steps: int = 0
    max_rows: int = 0  # 0: no cap (the whole table's cap, split evenly over the row shards)


def bad_ids(spec: TableSpec, ids: np.ndarray) -> str | None:
    """Why ``ids`` may not be sent to this table (None: fine). Checked before anything is touched."""
    if not len(ids):
        return None
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        return f"table {spec.name!r}: negative id {low}"
    if spec.num_rows and high >= spec.num_rows:
        return f"table {spec.name!r}: id {high} is out of range for {spec.num_rows} rows"
    if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():
        return f"table {spec.name!r}: ids must be distinct and sorted (torch.unique's order)"
    return None


def owner_of(ids: np.ndarray, parts: int) -> np.ndarray:
    """The part (server shard) each id's row lives on when a table is spread over ``parts`` shards."""
    return shard_of(ids, parts)


class SparseTable:
    def __init__(self, spec: TableSpec, optimizer: RowOptimizerSpec, *, shards: int = 1,
                 policy: RowPolicy = RowPolicy(), part: tuple[int, int] = (0, 1)) -> None:
        if not 1 <= shards <= 1024:
            raise ConfigError(f"sparse table {spec.name!r}: row shards must be in [1, 1024], got {shards}")
        if not 0 <= part[0] < part[1]:
            raise ConfigError(f"sparse table {spec.name!r}: part {part[0]} of {part[1]} does not exist")
        self.spec = spec
        self.optimizer = optimizer
        self.policy = policy
        self.part = (int(part[0]), int(part[1]))
        cap = -(-policy.max_rows // (shards * self.part[1])) if policy.max_rows else 0
        self.shards = [RowShard(spec.dim, optimizer, spec.initial_rows, admit_after=policy.admit_after,
                                ttl_steps=policy.ttl_steps, max_rows=cap) for _ in range(shards)]

    def _route(self, ids: np.ndarray) -> list[np.ndarray]:
        """Per shard, the positions in ``ids`` it owns (each in ids' order)."""
        if len(self.shards) == 1:
            return [np.arange(len(ids))]
        owner = shard_of(ids, len(self.shards), stride=self.part[1])
        order = np.argsort(owner, kind="stable")
        return np.split(order, np.cumsum(np.bincount(owner, minlength=len(self.shards)))[:-1])

    def foreign(self, ids: np.ndarray) -> str | None:
        """Why ``ids`` are not all this part's (None: they are). A client routing by another shard count
        would otherwise create rows here that the owning part also has."""
        index, parts = self.part
        if parts == 1 or not len(ids):
            return None
        owners = owner_of(ids, parts)
        wrong = np.flatnonzero(owners != index)
        if not len(wrong):
            return None
        return (f"table {self.spec.name!r}: id {int(ids[wrong[0]])} belongs to server shard {int(owners[wrong[0]])} "
                f"of {parts}, not to this shard {index} ({len(wrong)} such id(s)); the client routes rows over "
                "another number of shards than the server has")

    def lookup(self, ids: np.ndarray, step: int) -> torch.Tensor:
        """fp32 [n, dim] rows of distinct ``ids`` (rows created on first touch)."""
        if len(self.shards) == 1:
            return self.shards[0].lookup(ids, step)
        out = torch.empty(len(ids), self.spec.dim)
        for shard, pos in zip(self.shards, self._route(ids)):
            if len(pos):
                out[torch.from_numpy(pos)] = shard.lookup(ids[pos], step)
        return out

    def apply(self, ids: np.ndarray, grad: torch.Tensor, step: int, lr_scale: float = 1.0) -> None:
        """One row-wise optimizer update with ``grad`` (already summed per id and averaged)."""
        for shard, pos in zip(self.shards, self._route(ids)):
            if len(pos):
                shard.apply(ids[pos], grad if len(self.shards) == 1 else grad[torch.from_numpy(pos)], step, lr_scale)
            shard.evict(step)

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.shards)

    def stats(self) -> dict[str, int]:
        out = {"rows": self.num_rows, "candidates": sum(len(s.cand_keys) for s in self.shards)}
        for key in self.shards[0].counts:
            out[key] = sum(s.counts[key] for s in self.shards)
        return out

    def read_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every materialised row, in id order: (ids int64 [n], rows float32 [n, dim])."""
        parts = [s.state_dict() for s in self.shards]
        ids = np.concatenate([p["ids"].numpy() for p in parts])
        rows = torch.cat([p["rows"] for p in parts]).numpy()
        order = np.argsort(ids, kind="stable")
        return ids[order], rows[order]

    # -- checkpoints (one entry per row shard: each can be written by the process that holds it) ------
    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.to_dict(), "optimizer": self.optimizer.name,
                "shards": [s.state_dict() for s in self.shards]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore rows saved with any number of row shards (they are re-routed to this table's K)."""
        if state["optimizer"] != self.optimizer.name:
            raise ConfigError(f"sparse table {self.spec.name!r} was trained with {state['optimizer']!r} but "
                              f"ps.sparse.optimizer is {self.optimizer.name!r}; resume with the same optimizer")
        saved = dict(state["spec"])
        if int(saved["dim"]) != self.spec.dim:
            raise ConfigError(f"sparse table {self.spec.name!r} was saved {saved['dim']} wide, the model's is "
                              f"{self.spec.dim}")
        parts = state["shards"]
        ids = np.concatenate([p["ids"].numpy() for p in parts]) if parts else np.empty(0, np.int64)
        rows = torch.cat([p["rows"] for p in parts]) if parts else torch.empty(0, self.spec.dim)
        seen = np.concatenate([p["last_seen"].numpy() for p in parts]) if parts else np.empty(0, np.int64)
        opt = {name: torch.cat([p["state"][name] for p in parts]) for name in (parts[0]["state"] if parts else {})}
        if self.part[1] > 1:  # a whole table's state (or another split's part): keep this part's rows
            mine = np.flatnonzero(owner_of(ids, self.part[1]) == self.part[0])
            t = torch.from_numpy(mine)
            ids, rows, seen = ids[mine], rows[t], seen[mine]
            opt = {k: v[t] for k, v in opt.items()}
        for shard, pos in zip(self.shards, self._route(ids)):
            t = torch.from_numpy(pos)
            shard.load_rows(ids[pos], rows[t], {k: v[t] for k, v in opt.items()}, seen[pos])
        for shard in self.shards:
            shard.counts = {k: 0 for k in shard.counts}
        if self.part[0]:  # the table's counters come back once, on part 0 (the parts' stats are summed)
            return
        for part in parts:  # counters are the table's, whichever shard they were kept on
            for key, value in dict(part.get("counts") or {}).items():
                self.shards[0].counts[key] = self.shards[0].counts.get(key, 0) + int(value)
