"""``ShardlineEmbedding``: an embedding whose rows live on the parameter server, not in the model.

Design: the module holds no ``nn.Parameter``, so the model's flat dense vector (what the PS's dense
slices hold and allreduce would move) excludes the table. In ``forward(ids)`` it takes the batch's
distinct ids (``torch.unique(return_inverse=True)``), asks its *row source* for those rows, makes them a
leaf tensor that requires grad, and gathers; after backward that leaf's ``.grad`` is exactly the summed
gradient of each distinct row, which is what a step pushes. Sources:

* training: ``pipeline.worker.sparse_hook.SparseHook`` (pulls from the PS for the current step, then
  pushes every module's leaf gradients after backward);
* anywhere else (a fresh module, the served or scored model): ``LocalRows``, the table's rows as saved
  (``ids``/``rows`` arrays, looked up with ``np.searchsorted``), and for an id it does not hold the
  table's initial row (the same seeded value the server would have created: ``TableSpec.initial_rows``).

``prefetch`` lets a model that reads several tables (the built-in ``tabular``) pull them all in one
round trip before its forward. A user model opts in by using the module (``ShardlineEmbedding(name,
num_rows, dim)``); table names must be distinct within a model.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np
import torch
import torch.nn as nn

from pipeline.ps.sparse.table import TableSpec


class LocalRows:
    """Rows of one table in this process: saved (id, row) pairs, else the table's initial row."""

    def __init__(self, spec: TableSpec, ids: Optional[np.ndarray] = None, rows: Optional[np.ndarray] = None) -> None:
        self.spec = spec
        self.ids = np.empty(0, np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        self.values = np.empty((0, spec.dim), np.float32) if rows is None else np.asarray(rows, dtype=np.float32)
        if len(self.ids) > 1 and not (self.ids[1:] > self.ids[:-1]).all():
            order = np.argsort(self.ids, kind="stable")
            self.ids, self.values = self.ids[order], self.values[order]

    def rows(self, module: "ShardlineEmbedding", ids: torch.Tensor) -> torch.Tensor:
        wanted = ids.cpu().numpy()
        out = self.spec.initial_rows(wanted)
        if len(self.ids) and len(wanted):
            pos = np.minimum(np.searchsorted(self.ids, wanted), len(self.ids) - 1)
            hit = self.ids[pos] == wanted
            out[hit] = self.values[pos[hit]]
        return torch.from_numpy(out)


class ShardlineEmbedding(nn.Module):
    """``nn.Embedding(num_rows, dim)`` with its rows on the parameter server (see module docstring).
    ``num_rows`` 0: unbounded hashed ids (any int64 >= 0)."""

    shardline_sparse = True  # what TabularInput prefetches (a frozen table is a plain lookup)

    def __init__(self, name: str, num_rows: int, dim: int, *, init_std: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        self.spec = TableSpec(name, dim, num_rows, init_std, seed)
        self.source: Any = LocalRows(self.spec)
        self.pulled: list[tuple[torch.Tensor, torch.Tensor]] = []  # this step's (distinct ids, leaf rows)
        self._staged: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None

    @property
    def embedding_dim(self) -> int:
        return self.spec.dim

    def extra_repr(self) -> str:
        return f"{self.spec.name!r}, {self.spec.num_rows or 'unbounded'}, {self.spec.dim}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] is ids:
            _, unique, inverse, rows = staged
        else:
            unique, inverse = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)
            rows = self.source.rows(self, unique)
        rows = rows.to(ids.device) if rows.device != ids.device else rows
        if self.training and torch.is_grad_enabled():
            rows = rows.detach().requires_grad_(True)
            self.pulled.append((unique, rows))
        return rows[inverse].reshape(*ids.shape, self.spec.dim)

    def load_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Serve these rows locally (after training, or from a saved table artifact)."""
        self.source = LocalRows(self.spec, ids, rows)


def sparse_modules(model: nn.Module) -> list[ShardlineEmbedding]:
    """The model's sparse tables in ``modules()`` order: the table index the wire uses."""
    return [m for m in model.modules() if isinstance(m, ShardlineEmbedding)]


def prefetch(pairs: Iterable[tuple[ShardlineEmbedding, torch.Tensor]]) -> None:
    """Rows of several tables fetched together (one round trip on the PS) for the next forward of each."""
    pairs = list(pairs)
    staged = []
    for module, ids in pairs:
        unique, inverse = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)
        staged.append((module, ids, unique, inverse))
    groups: dict[int, list] = {}
    for item in staged:
        groups.setdefault(id(item[0].source), []).append(item)
    for items in groups.values():
        source = items[0][0].source
        if hasattr(source, "rows_many"):
            rows = source.rows_many([(m, u) for m, _, u, _ in items])
        else:
            rows = [m.source.rows(m, u) for m, _, u, _ in items]
        for (module, ids, unique, inverse), r in zip(items, rows):
            module._staged = (ids, unique, inverse, r)


# -- the trained tables as files: <dir>/<table name>/ids.npy (int64 [n], ascending) + rows.npy (float32 [n, dim])
def save_tables(tables: dict[str, tuple[np.ndarray, np.ndarray]], directory: str) -> str:
    """Write each table's (ids, rows) as ``<directory>/<name>/ids.npy`` + ``rows.npy``; returns ``directory``."""
    import os

    for name, (ids, rows) in tables.items():
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        np.save(os.path.join(directory, name, "ids.npy"), np.asarray(ids, dtype=np.int64))
        np.save(os.path.join(directory, name, "rows.npy"), np.asarray(rows, dtype=np.float32))
    return directory


def load_tables(model: nn.Module, directory: str) -> None:
    """Serve every sparse table of ``model`` from ``directory`` (memory-mapped: a partition that scores a
    few thousand ids reads only their pages). A table missing there serves its initial rows."""
    import os

    if not os.path.isdir(directory):  # never score with initial rows because the trained ones are elsewhere
        raise FileNotFoundError(f"the trained sparse tables are in {directory}, which this process cannot see; "
                                "run where that folder is (local Spark), or put workdir on a mount every host has "
                                "and set workdir_on_every_host=true")
    for module in sparse_modules(model):
        path = os.path.join(directory, module.spec.name)
        if os.path.exists(os.path.join(path, "ids.npy")):
            module.load_rows(np.load(os.path.join(path, "ids.npy"), mmap_mode="r"),
                             np.load(os.path.join(path, "rows.npy"), mmap_mode="r"))


class FrozenSparseEmbedding(nn.Module):
    """A trained sparse table as plain torch ops, for the exported served model (torch.export/TorchScript
    cannot call numpy): ``torch.searchsorted`` over the sorted ids, the rows as a buffer, and one extra
    row of zeros for an id the table does not hold (the expected value of an initial row; the Python
    paths, evaluation and ``shardline score``, serve the exact seeded initial row instead)."""

    def __init__(self, ids: np.ndarray, rows: np.ndarray) -> None:
        super().__init__()
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        self.register_buffer("ids", torch.from_numpy(ids.copy() if len(ids) else np.array([-1], np.int64)))
        oov = np.zeros((1, rows.shape[1]), np.float32)
        self.register_buffer("weight", torch.from_numpy(np.concatenate([rows, oov]) if len(ids) else oov.repeat(2, 0)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        pos = torch.searchsorted(self.ids, flat).clamp(max=self.ids.shape[0] - 1)
        hit = self.ids[pos] == flat
        index = torch.where(hit, pos, torch.full_like(pos, self.weight.shape[0] - 1))
        return self.weight[index].reshape(ids.shape + (self.weight.shape[1],))


def freeze_sparse(model: nn.Module) -> nn.Module:
    """``model`` with each ShardlineEmbedding replaced (in place) by a FrozenSparseEmbedding of the rows it
    serves locally; a model without sparse tables is returned as it is."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, ShardlineEmbedding):
                source = child.source
                if not isinstance(source, LocalRows):
                    raise ValueError(f"sparse table {child.spec.name!r} is still bound to the parameter server; "
                                     "load its trained rows (load_rows/load_tables) before freezing")
                setattr(parent, name, FrozenSparseEmbedding(np.asarray(source.ids), np.asarray(source.values)))
    return model
