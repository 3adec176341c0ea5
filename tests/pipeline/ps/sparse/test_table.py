"""The server's row store: rows on first touch, reproducible init, row-wise optimizers equal to torch's
on a dense table, admission, eviction, checkpoints across row-shard counts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.ps.sparse.rowopt import RowOptimizerSpec
from pipeline.ps.sparse.table import RowPolicy, SparseTable, TableSpec, bad_ids

SPEC = TableSpec("c1", dim=4, num_rows=1000, init_std=0.5, seed=3)


def _ids(*values: int) -> np.ndarray:
    return np.array(sorted(values), dtype=np.int64)


def test_rows_exist_only_once_touched_and_init_is_seeded_by_table_and_id():
    one = SparseTable(SPEC, RowOptimizerSpec("sgd", lr=0.1), shards=1)
    four = SparseTable(SPEC, RowOptimizerSpec("sgd", lr=0.1), shards=4)
    assert one.num_rows == 0
    ids = _ids(999, 5, 17, 400)
    first = one.lookup(ids, step=0)
    assert one.num_rows == 4 and one.stats()["created"] == 4
    assert torch.equal(first, four.lookup(ids, step=0))  # the same rows whichever shard count holds them
    assert torch.equal(first, torch.from_numpy(SPEC.initial_rows(ids)))
    assert {s.num_rows for s in four.shards} != {4}  # spread over shards
    other = SparseTable(TableSpec("c2", 4, 1000, 0.5, 3), RowOptimizerSpec("sgd"))
    assert not torch.equal(first, other.lookup(ids, 0))  # another table: other rows
    one.lookup(ids, 1)
    assert one.num_rows == 4  # touched again: no new rows


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_row_optimizer_equals_torch_on_a_dense_table(name):
    spec = TableSpec("t", dim=3, num_rows=50, init_std=1.0)
    opt = RowOptimizerSpec(name, lr=0.3)
    table = SparseTable(spec, opt, shards=3)
    dense = torch.nn.Parameter(torch.from_numpy(spec.initial_rows(np.arange(50))))
    ref = torch.optim.SGD([dense], lr=0.3) if name == "sgd" else torch.optim.Adagrad([dense], lr=0.3)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        ids = torch.unique(torch.randint(0, 50, (12,), generator=gen))
        grad = torch.randn(len(ids), 3, generator=gen)
        table.lookup(ids.numpy(), step)
        table.apply(ids.numpy(), grad.clone(), step)
        dense.grad = torch.zeros(50, 3).index_add_(0, ids, grad)
        ref.step()
    ids, rows = table.read_rows()
    assert torch.allclose(torch.from_numpy(rows), dense.detach()[torch.from_numpy(ids)], atol=1e-6)


def test_lazy_adam_keeps_a_step_count_per_row():
    table = SparseTable(TableSpec("t", 2), RowOptimizerSpec("adam", lr=0.1))
    table.lookup(_ids(1, 2), 0)
    table.apply(_ids(1, 2), torch.ones(2, 2), 0)
    table.lookup(_ids(2), 1)
    table.apply(_ids(2), torch.ones(1, 2), 1)
    steps = table.shards[0].state_dict()["state"]["steps"]
    assert steps.tolist() == [1, 2]
    ids, rows = table.read_rows()
    start = TableSpec("t", 2).initial_rows(ids)
    # Adam's first step moves every coordinate by lr (bias-corrected): row 1 moved once, row 2 twice.
    assert np.allclose(start[0] - rows[0], 0.1, atol=1e-6) and np.allclose(start[1] - rows[1], 0.2, atol=1e-5)


def test_admission_reads_init_drops_gradients_until_the_nth_touch():
    table = SparseTable(SPEC, RowOptimizerSpec("sgd", lr=1.0), policy=RowPolicy(admit_after=3))
    ids = _ids(7, 8)
    init = torch.from_numpy(SPEC.initial_rows(ids))
    for step in range(2):
        assert torch.equal(table.lookup(ids, step), init)
        table.apply(ids, torch.ones(2, 4), step)
    stats = table.stats()
    assert stats["rows"] == 0 and stats["dropped_grads"] == 4 and stats["candidates"] == 2
    table.lookup(ids, 2)  # third touch: admitted, starting from the init
    table.apply(ids, torch.ones(2, 4), 2)
    assert table.stats()["rows"] == 2 and table.stats()["candidates"] == 0
    assert torch.allclose(table.lookup(ids, 3), init - 1)


def test_eviction_by_ttl_and_by_row_cap():
    ttl = SparseTable(SPEC, RowOptimizerSpec("sgd"), policy=RowPolicy(ttl_steps=2))
    ttl.lookup(_ids(1, 2), 0)
    for step in range(1, 5):
        ttl.lookup(_ids(2), step)
        ttl.apply(_ids(2), torch.zeros(1, 4), step)
    assert ttl.read_rows()[0].tolist() == [2] and ttl.stats()["evicted"] == 1
    capped = SparseTable(SPEC, RowOptimizerSpec("sgd"), policy=RowPolicy(max_rows=3))
    for step, i in enumerate(range(10)):
        capped.lookup(_ids(i), step)
        capped.apply(_ids(i), torch.zeros(1, 4), step)
    assert capped.read_rows()[0].tolist() == [7, 8, 9]  # the least recently seen went first
    assert capped.stats()["evicted"] == 7
    capped.lookup(_ids(11), 20)  # freed slots are reused: capacity does not grow
    assert capped.shards[0].used <= 4


def test_state_dict_round_trips_across_row_shard_counts():
    table = SparseTable(SPEC, RowOptimizerSpec("adagrad", lr=0.5), shards=4)
    ids = _ids(*range(0, 200, 7))
    table.lookup(ids, 0)
    table.apply(ids, torch.ones(len(ids), 4), 0)
    state = table.state_dict()
    assert len(state["shards"]) == 4  # one entry per row shard
    other = SparseTable(SPEC, RowOptimizerSpec("adagrad", lr=0.5), shards=2)
    other.load_state_dict(state)
    for t in (table, other):
        t.lookup(ids, 1)
        t.apply(ids, torch.ones(len(ids), 4), 1)
    assert np.array_equal(table.read_rows()[1], other.read_rows()[1])
    with pytest.raises(ConfigError, match="ps.sparse.optimizer"):
        SparseTable(SPEC, RowOptimizerSpec("sgd")).load_state_dict(state)


def test_bad_ids_name_the_table_and_the_problem():
    assert "negative id -1" in bad_ids(SPEC, np.array([-1, 2]))
    assert "out of range for 1000 rows" in bad_ids(SPEC, np.array([1, 1000]))
    assert "distinct and sorted" in bad_ids(SPEC, np.array([3, 3]))
    assert bad_ids(TableSpec("h", 4), np.array([0, 2**62])) is None  # unbounded: any id >= 0
