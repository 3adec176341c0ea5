"""A table spread over server shards (ps.placement=hosts): each part owns the ids hashed to it and refuses
others, and the parts' states merge into one checkpoint that any split (or one shard) loads again."""
from __future__ import annotations

import numpy as np
import torch

from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.sparse.parts import merge_states, merge_stats, split_state
from pipeline.ps.sparse.rowopt import RowOptimizerSpec
from pipeline.ps.sparse.spec import SparseSpec
from pipeline.ps.sparse.table import TableSpec, owner_of

SPEC = SparseSpec((TableSpec("c1", 4, 0, 0.5, 3), TableSpec("c2", 2, 500, 0.5, 3)),
                  RowOptimizerSpec("adagrad", lr=0.2), row_shards=3)
IDS = np.arange(0, 400, 3, dtype=np.int64)


def _trained(part: tuple[int, int]):
    store = SPEC.build(Consistency(), 1, part=part)
    for index, table in enumerate(store.tables):
        mine = IDS[owner_of(IDS, part[1]) == part[0]]
        assert store.check_ids(index, mine) is None
        table.lookup(mine, 0)
        table.apply(mine, torch.full((len(mine), table.spec.dim), 0.5), 0)
    return store


def _rows(state: dict, name: str) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    shards = state[name]["shards"]
    ids = torch.cat([s["ids"] for s in shards]).numpy()
    order = np.argsort(ids)
    return (ids[order], torch.cat([s["rows"] for s in shards])[order],
            torch.cat([s["state"]["sum"] for s in shards])[order])


def test_each_part_owns_the_ids_hashed_to_it_and_names_the_others():
    owners = owner_of(IDS, 3)
    assert set(owners.tolist()) == {0, 1, 2}
    store = SPEC.build(Consistency(), 1, part=(1, 3))
    assert store.parts == 3
    why = store.check_ids(0, IDS)
    assert why is not None and "belongs to server shard" in why and "not to this shard 1" in why
    assert store.check_ids(0, IDS[owners == 1]) is None


def test_parts_merge_into_the_state_one_shard_has_and_split_back():
    whole = _trained((0, 1))
    parts = [_trained((p, 3)) for p in range(3)]
    merged = merge_states([p.state_locked() for p in parts])
    for name in ("c1", "c2"):
        ids, rows, acc = _rows(merged, name)
        want_ids, want_rows, want_acc = _rows(whole.state_locked(), name)
        assert np.array_equal(ids, want_ids) and torch.equal(rows, want_rows) and torch.equal(acc, want_acc)
    assert merge_stats([p.stats_locked() for p in parts])["tables"]["c1"]["created"] == len(IDS)

    again = [SPEC.build(Consistency(), 1, part=(p, 2)) for p in range(2)]  # re-spread over two shards
    for p, piece in enumerate(split_state(merged, 2)):
        assert all(set(owner_of(s["ids"].numpy(), 2).tolist()) <= {p} for s in piece["c1"]["shards"])
        again[p].restore_locked(piece)
    assert sum(t.tables[0].num_rows for t in again) == len(IDS)
    assert again[0].tables[0].stats()["created"] == len(IDS) and again[1].tables[0].stats()["created"] == 0

    one = SPEC.build(Consistency(), 1)  # and the driver's single store loads the spread checkpoint
    one.restore_locked(merged)
    ids, rows, _ = _rows(one.state_locked(), "c1")
    assert np.array_equal(ids, _rows(merged, "c1")[0]) and torch.equal(rows, _rows(merged, "c1")[1])


def test_a_part_loading_a_whole_table_keeps_only_its_rows():
    whole = _trained((0, 1)).state_locked()
    part = SPEC.build(Consistency(), 1, part=(2, 3))
    part.restore_locked(whole)
    ids = _rows(part.state_locked(), "c1")[0]
    assert len(ids) and set(owner_of(ids, 3).tolist()) == {2}
