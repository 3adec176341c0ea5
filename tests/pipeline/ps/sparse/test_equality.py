"""Acceptance: sparse training through the PS (sync, 2 ranks) equals single-process training of the same
model with dense tables holding the same initial rows: dense parameters and table rows within 1e-5."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from pipeline.models import flat_parameters
from pipeline.ps.sparse.rowopt import RowOptimizerSpec

from tests.pipeline.ps.sparse.helpers import DIM, ROWS, TwoTables, batch, make_server, run_ranks, train_rank

STEPS = 6


class DenseTwoTables(nn.Module):
    def __init__(self, sparse: TwoTables) -> None:
        super().__init__()
        self.a = nn.Embedding(ROWS, DIM)
        self.b = nn.Embedding(ROWS, DIM)
        with torch.no_grad():
            for dense, table in ((self.a, sparse.a), (self.b, sparse.b)):
                dense.weight.copy_(torch.from_numpy(table.spec.initial_rows(np.arange(ROWS))))
        self.head = nn.Linear(3 * DIM, 1)
        self.head.load_state_dict(sparse.head.state_dict())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(ids[:, 0]), self.a(ids[:, 1]), self.b(ids[:, 2])], dim=1)).squeeze(1)


def _reference(name: str, world_size: int) -> DenseTwoTables:
    torch.manual_seed(0)
    model = DenseTwoTables(TwoTables())
    tables = [model.a.weight, model.b.weight]
    dense_opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    table_opt = torch.optim.SGD(tables, lr=0.2) if name == "sgd" else torch.optim.Adagrad(tables, lr=0.2)
    for step in range(STEPS):
        parts = [batch(rank, step) for rank in range(world_size)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        dense_opt.zero_grad()
        table_opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # equal batches: the mean of the ranks' means
        dense_opt.step()
        table_opt.step()
    return model


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_sync_sparse_training_equals_single_process(secret, name):
    def model_fn() -> TwoTables:
        torch.manual_seed(0)
        return TwoTables()

    server = make_server(model_fn(), secret, world_size=2, row_opt=RowOptimizerSpec(name, lr=0.2), shards=2)
    try:
        run_ranks(2, lambda rank: train_rank(server, secret, rank, STEPS, model_fn))
        reference = _reference(name, 2)
        assert torch.allclose(server.parameters(), flat_parameters(reference.head), atol=1e-5)
        tables = server.state_dict()["sparse"]
        for table_name, dense in (("a", reference.a.weight), ("b", reference.b.weight)):
            shards = tables[table_name]["shards"]
            ids = torch.cat([s["ids"] for s in shards])
            rows = torch.cat([s["rows"] for s in shards])
            assert len(ids) > ROWS // 2  # the test touches most rows; untouched ones never materialise
            assert torch.allclose(rows, dense.detach()[ids], atol=1e-5)
        stats = server.stats["sparse"]
        assert stats["pushes"] == 2 * 2 * STEPS and stats["rejected_frames"] == 0
    finally:
        server.close()
