"""A real parameter server with sparse tables and rank threads that train a small model through it."""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.nn as nn

from pipeline.models import flat_gradients, flat_parameters, load_flat_parameters
from pipeline.models.sparse_embedding import ShardlineEmbedding, sparse_modules
from pipeline.ps import OptimizerSpec, ParameterServer, PSClient, PSSettings
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.sparse.rowopt import RowOptimizerSpec
from pipeline.ps.sparse.store import SparseStore
from pipeline.ps.sparse.table import RowPolicy, SparseTable
from pipeline.wire.deadline import STEP_KEY, Timeout
from pipeline.worker.sparse_hook import SparseHook

HOST = "127.0.0.1"
ROWS, DIM = 40, 3


class TwoTables(nn.Module):
    """Two sparse tables (one read twice per row) and a dense head."""

    def __init__(self, rows: int = ROWS, dim: int = DIM) -> None:
        super().__init__()
        self.a = ShardlineEmbedding("a", rows, dim, init_std=0.5, seed=1)
        self.b = ShardlineEmbedding("b", rows, dim, init_std=0.5, seed=1)
        self.head = nn.Linear(3 * dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(ids[:, 0]), self.a(ids[:, 1]), self.b(ids[:, 2])], dim=1)).squeeze(1)


def make_server(model: nn.Module, secret: bytes, *, world_size: int, row_opt: RowOptimizerSpec,
                dense_lr: float = 0.1, consistency: Consistency | None = None, shards: int = 1,
                row_shards: int = 2, policy: RowPolicy = RowPolicy(), wire_dtype: str = "fp32",
                timeout_s: float = 5.0) -> ParameterServer:
    consistency = consistency or Consistency()
    store = SparseStore([SparseTable(m.spec, row_opt, shards=row_shards, policy=policy) for m in sparse_modules(model)],
                        consistency, world_size, wire_dtype=wire_dtype)
    settings = PSSettings(optimizer=OptimizerSpec(name="sgd", lr=dense_lr), consistency=consistency, shards=shards,
                          step_timeout=Timeout.of(timeout_s, STEP_KEY))
    return ParameterServer(flat_parameters(model), settings, world_size=world_size, secret=secret, host=HOST,
                           sparse=store).start()


def batch(rank: int, step: int, size: int = 8, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, rows, (size, 3), generator=gen), torch.randn(size, generator=gen)


def train_rank(server: ParameterServer, secret: bytes, rank: int, steps: int, model_fn: Callable[[], nn.Module],
               *, wire_dtype: str = "fp32", before_step: Callable[[PSClient, int], None] | None = None,
               mode: str = "sync", generation: int = 1) -> nn.Module:
    model = model_fn()
    host, port = server.address
    with PSClient(host, port, rank=rank, secret=secret, timeout_s=5.0, generation=generation) as client:
        client.connect()
        hook = SparseHook(client, sparse_modules(model), wire_dtype)
        first, params = client.pull(0)
        load_flat_parameters(model, params)
        for step in range(first if mode == "sync" else client.info.clock, steps):  # a retry resumes
            if before_step is not None:
                before_step(client, step)
            x, y = batch(rank, step)
            hook.before_forward(step)
            for p in model.parameters():
                p.grad = None
            nn.functional.mse_loss(model(x), y).backward()
            hook.after_backward(step)
            if mode == "async":
                client.push(step, flat_gradients(model))
                _, params = client.pull(0)
            else:
                _, params = client.push_pull(step, flat_gradients(model))
            load_flat_parameters(model, params)
        client.finish()
    return model


def run_ranks(world_size: int, target: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = target(rank)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    return results
