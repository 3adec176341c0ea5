"""The flat loop's sparse step: before forward, bind every ``ShardlineEmbedding`` to this step's pulls;
after backward, push each table's summed row gradients (before the dense push of the same step, which
is what lets a synchronous server apply both at once: ``pipeline.ps.sparse.store``).

``sparse_hook(client, model, ...)`` is None for a model without sparse tables, so the loop's two calls
cost nothing then.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

log = logging.getLogger(__name__)


class SparseHook:
    def __init__(self, client: Any, modules: list, wire_dtype: str = "fp32") -> None:
        from pipeline.ps.sparse.client import SparseLink

        self.link = SparseLink(client, wire_dtype)
        self.modules = modules
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.step = 0
        self.wait_s = 0.0
        for module in modules:
            module.source = self

    # -- the row source the modules call in forward ----------------------------------------------------
    def rows(self, module, ids):
        return self.rows_many([(module, ids)])[0]

    def rows_many(self, pairs):
        started = time.perf_counter()
        out = self.link.pull(self.step, [(self.index[id(m)], m.spec.dim, ids.cpu().numpy()) for m, ids in pairs])
        self.wait_s += time.perf_counter() - started
        return out

    # -- the loop's two calls ------------------------------------------------------------------------------
    def before_forward(self, step: int) -> None:
        self.step = step
        for module in self.modules:
            module.pulled.clear()

    def after_backward(self, step: int) -> None:
        import torch

        pushes = []
        for i, module in enumerate(self.modules):
            for ids, leaf in module.pulled:
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                pushes.append((i, ids.cpu().numpy(), grad))
            module.pulled.clear()
        pushes = _merge(pushes)
        started = time.perf_counter()
        self.link.push(step, pushes)
        self.wait_s += time.perf_counter() - started

    def take_stats(self) -> dict[str, float]:
        out = {"sparse_wait_s": self.wait_s, "sparse_bytes_sent": float(self.link.bytes_sent),
               "sparse_bytes_received": float(self.link.bytes_received)}
        self.wait_s = 0.0
        self.link.bytes_sent = self.link.bytes_received = 0
        return out


def _merge(pushes: list) -> list:
    """One push per table: a module called twice in a step has its rows summed per id."""
    import numpy as np
    import torch

    by_table: dict[int, list] = {}
    for index, ids, grad in pushes:
        by_table.setdefault(index, []).append((ids, grad))
    merged = []
    for index, parts in by_table.items():
        if len(parts) == 1:
            merged.append((index, parts[0][0], parts[0][1].detach().cpu()))
            continue
        ids, inverse = np.unique(np.concatenate([p[0] for p in parts]), return_inverse=True)
        grad = torch.zeros(len(ids), parts[0][1].shape[1]).index_add_(
            0, torch.from_numpy(inverse), torch.cat([p[1].detach().cpu() for p in parts]))
        merged.append((index, ids, grad))
    return merged


def sparse_hook(client: Any, model: Any, *, mode: str, overlap: bool = False, backend: str = "ps",
                wire_dtype: str = "fp32") -> Optional[SparseHook]:
    """The hook for ``model``'s sparse tables, or None when it has none; refuses what cannot train them."""
    from pipeline.models.sparse_embedding import sparse_modules

    modules = sparse_modules(model)
    if not modules:
        return None
    if backend != "ps":
        raise ValueError("sparse embedding tables (ShardlineEmbedding, ps.sparse.min_rows) train on the "
                         f"parameter server only; train.backend={backend!r} cannot hold them")
    if overlap:
        raise ValueError("ps.overlap pushes dense buckets during backward, before the step's sparse rows; "
                         "set ps.overlap=false to train sparse embedding tables")
    if mode == "average":
        raise ValueError("ps.mode=average cannot train sparse embedding tables (use sync, ssp or async)")
    log.info("%d sparse table(s) on the parameter server: %s", len(modules),
             ", ".join(f"{m.spec.name}[{m.spec.num_rows or 'unbounded'}x{m.spec.dim}]" for m in modules))
    return SparseHook(client, modules, wire_dtype)
