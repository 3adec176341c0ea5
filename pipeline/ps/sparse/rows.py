"""One row shard of a sparse table: the rows of the ids that hash to it, created on first touch.

Layout: ``keys`` (sorted int64 ids) and ``slot_of`` (each key's slot) form the index; a lookup is one
``np.searchsorted`` over the batch's ids, never a Python loop per id. Rows and their optimizer state sit
in slot arrays that grow by doubling; evicted slots go to a free list and are reused. Plain tensors and
arrays only, with ``state_dict``/``load_state_dict``, so a shard can live in any process.

Admission (``admit_after`` N > 1): an id becomes a row at its N-th touch; before that it reads as its
initial value (never stored) and its gradients are dropped and counted. Eviction: rows unseen for
``ttl_steps`` steps, and the least recently seen rows beyond ``max_rows``; an evicted id that comes back
starts again from its initial value.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from pipeline.ps.sparse.rowopt import RowOptimizerSpec, new_state, step_rows

_MIN_CAPACITY = 64

InitFn = Callable[[np.ndarray], np.ndarray]  # ids -> float32 [n, dim] initial rows


class RowShard:
    def __init__(self, dim: int, optimizer: RowOptimizerSpec, init: InitFn, *, admit_after: int = 1,
                 ttl_steps: int = 0, max_rows: int = 0) -> None:
        self.dim = dim
        self.optimizer = optimizer
        self.init = init
        self.admit_after = admit_after
        self.ttl_steps = ttl_steps
        self.max_rows = max_rows
        self.keys = np.empty(0, dtype=np.int64)
        self.slot_of = np.empty(0, dtype=np.int64)
        self.free = np.empty(0, dtype=np.int64)
        self.used = 0  # slots ever handed out (free ones included)
        self.rows = torch.zeros(_MIN_CAPACITY, dim)
        self.state = new_state(optimizer, _MIN_CAPACITY, dim)
        self.last_seen = np.zeros(_MIN_CAPACITY, dtype=np.int64)
        # Admission candidates: sorted ids seen fewer than admit_after times, and their counts.
        self.cand_keys = np.empty(0, dtype=np.int64)
        self.cand_counts = np.empty(0, dtype=np.int64)
        self.counts = {"created": 0, "evicted": 0, "dropped_grads": 0, "not_admitted_reads": 0}

    @property
    def num_rows(self) -> int:
        return len(self.keys)

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where it has no row."""
        if not len(self.keys):
            return np.full(len(ids), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.keys, ids), len(self.keys) - 1)
        return np.where(self.keys[pos] == ids, self.slot_of[pos], -1)

    # -- reads ---------------------------------------------------------------------------------------
    def lookup(self, ids: np.ndarray, step: int) -> torch.Tensor:
        """fp32 [n, dim] rows of distinct ``ids`` (created or counted towards admission on this touch)."""
        slots = self.find(ids)
        missing = slots < 0
        if missing.any():
            admitted = self._admit(ids[missing])
            if admitted.any():
                new_ids = ids[missing][admitted]
                slots[np.flatnonzero(missing)[admitted]] = self._create(new_ids)
        out = torch.empty(len(ids), self.dim)
        have = slots >= 0
        if have.all():
            out = self.rows.index_select(0, torch.from_numpy(slots))
        else:
            hit = np.flatnonzero(have)
            if len(hit):
                out[torch.from_numpy(hit)] = self.rows.index_select(0, torch.from_numpy(slots[hit]))
            cold = np.flatnonzero(~have)
            out[torch.from_numpy(cold)] = torch.from_numpy(self.init(ids[cold]))
            self.counts["not_admitted_reads"] += len(cold)
        self.last_seen[slots[have]] = step
        return out

    def _admit(self, ids: np.ndarray) -> np.ndarray:
        """Count one touch of each (row-less) id; True where that made it a row."""
        if self.admit_after <= 1:
            return np.ones(len(ids), dtype=bool)
        pos = np.searchsorted(self.cand_keys, ids)
        known = pos < len(self.cand_keys)
        known[known] = self.cand_keys[pos[known]] == ids[known]
        counts = np.ones(len(ids), dtype=np.int64)
        counts[known] = self.cand_counts[pos[known]] + 1
        admitted = counts >= self.admit_after
        self.cand_counts[pos[known]] = counts[known]
        fresh = np.flatnonzero(~known & ~admitted)
        fresh = fresh[np.argsort(ids[fresh], kind="stable")]  # np.insert keeps the given order per position
        self.cand_keys = np.insert(self.cand_keys, pos[fresh], ids[fresh])
        self.cand_counts = np.insert(self.cand_counts, pos[fresh], counts[fresh])
        if (admitted & known).any():  # admitted candidates leave the candidate list
            keep = ~np.isin(self.cand_keys, ids[admitted & known])
            self.cand_keys, self.cand_counts = self.cand_keys[keep], self.cand_counts[keep]
        return admitted

    def _create(self, ids: np.ndarray) -> np.ndarray:
        """Rows for sorted-or-not distinct new ``ids`` at their initial values; returns their slots."""
        n = len(ids)
        reuse = self.free[:n]
        self.free = self.free[n:]
        fresh = np.arange(self.used, self.used + n - len(reuse), dtype=np.int64)
        self.used += len(fresh)
        slots = np.concatenate([reuse, fresh])
        self._reserve(self.used)
        t = torch.from_numpy(slots)
        self.rows.index_copy_(0, t, torch.from_numpy(self.init(ids)))
        for name, tensor in self.state.items():
            tensor.index_fill_(0, t, 0)
        order = np.argsort(ids, kind="stable")
        pos = np.searchsorted(self.keys, ids[order])
        self.keys = np.insert(self.keys, pos, ids[order])
        self.slot_of = np.insert(self.slot_of, pos, slots[order])
        self.counts["created"] += n
        return slots

    def _reserve(self, needed: int) -> None:
        capacity = self.capacity
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        self.rows = _grown(self.rows, capacity)
        self.state = {name: _grown(t, capacity) for name, t in self.state.items()}
        self.last_seen = np.concatenate([self.last_seen, np.zeros(capacity - len(self.last_seen), np.int64)])

    # -- updates -------------------------------------------------------------------------------------
    def apply(self, ids: np.ndarray, grad: torch.Tensor, step: int, lr_scale: float = 1.0) -> None:
        """One optimizer update of the rows of distinct ``ids``; gradients of row-less ids are dropped."""
        slots = self.find(ids)
        have = slots >= 0
        if not have.all():
            self.counts["dropped_grads"] += int((~have).sum())
            grad = grad[torch.from_numpy(np.flatnonzero(have))]
            slots = slots[have]
        if len(slots):
            step_rows(self.optimizer, self.rows, self.state, torch.from_numpy(slots), grad, lr_scale)
            self.last_seen[slots] = step

    def evict(self, step: int) -> int:
        """Rows unseen for ttl_steps, then the least recently seen beyond max_rows; returns how many."""
        if not len(self.keys) or not (self.ttl_steps or self.max_rows):
            return 0
        seen = self.last_seen[self.slot_of]
        drop = seen < step - self.ttl_steps if self.ttl_steps else np.zeros(len(seen), dtype=bool)
        if self.max_rows and len(self.keys) - drop.sum() > self.max_rows:
            alive = np.flatnonzero(~drop)
            excess = len(alive) - self.max_rows
            oldest = alive[np.argpartition(seen[alive], excess - 1)[:excess]]
            drop[oldest] = True
        n = int(drop.sum())
        if n:
            self.free = np.concatenate([self.free, self.slot_of[drop]])
            self.keys, self.slot_of = self.keys[~drop], self.slot_of[~drop]
            self.counts["evicted"] += n
        return n

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The shard's rows in id order (plain tensors; free slots are not saved)."""
        t = torch.from_numpy(self.slot_of.copy())
        return {"ids": torch.from_numpy(self.keys.copy()), "rows": self.rows.index_select(0, t),
                "state": {name: s.index_select(0, t) for name, s in self.state.items()},
                "last_seen": torch.from_numpy(self.last_seen[self.slot_of]),
                "cand_ids": torch.from_numpy(self.cand_keys.copy()),
                "cand_counts": torch.from_numpy(self.cand_counts.copy()), "counts": dict(self.counts)}

    def load_rows(self, ids: np.ndarray, rows: torch.Tensor, state: dict[str, torch.Tensor],
                  last_seen: np.ndarray) -> None:
        """Replace every row with the given ones (ids distinct); state names must be this optimizer's."""
        order = np.argsort(ids, kind="stable")
        n = len(ids)
        self.keys, self.slot_of = ids[order].copy(), np.arange(n, dtype=np.int64)
        self.free, self.used = np.empty(0, dtype=np.int64), n
        capacity = max(_MIN_CAPACITY, 1 << max(n - 1, 0).bit_length())
        self.rows = torch.zeros(capacity, self.dim)
        self.rows[:n] = rows[torch.from_numpy(order)]
        self.state = new_state(self.optimizer, capacity, self.dim)
        for name, tensor in self.state.items():
            if name in state:
                tensor[:n] = state[name][torch.from_numpy(order)]
        self.last_seen = np.zeros(capacity, dtype=np.int64)
        self.last_seen[:n] = last_seen[order]


def _grown(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    out = torch.zeros((capacity, *tensor.shape[1:]), dtype=tensor.dtype)
    out[: tensor.shape[0]] = tensor
    return out
