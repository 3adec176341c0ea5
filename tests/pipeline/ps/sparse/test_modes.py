"""Sparse rows in async and ssp, fp16 rows on the wire, and checkpoints that resume the rows."""
from __future__ import annotations

import torch

from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.sparse.rowopt import RowOptimizerSpec
from tests.pipeline.ps.sparse.helpers import TwoTables, make_server, run_ranks, train_rank

STEPS = 4


def _model() -> TwoTables:
    torch.manual_seed(0)
    return TwoTables()


def _rows(server) -> dict[str, torch.Tensor]:
    tables = server.state_dict()["sparse"]
    out = {}
    for name, table in tables.items():
        ids = torch.cat([s["ids"] for s in table["shards"]])
        rows = torch.cat([s["rows"] for s in table["shards"]])
        out[name] = rows[torch.argsort(ids)]
    return out


def _train(secret, *, mode="sync", world_size=1, steps=STEPS, wire_dtype="fp32", name="adagrad", **kw):
    consistency = Consistency(mode=mode, staleness=1) if mode == "ssp" else Consistency(mode=mode)
    server = make_server(_model(), secret, world_size=world_size, row_opt=RowOptimizerSpec(name, lr=0.2),
                         consistency=consistency, wire_dtype=wire_dtype, **kw)
    run_ranks(world_size, lambda rank: train_rank(server, secret, rank, steps, _model, mode=mode,
                                                  wire_dtype=wire_dtype))
    return server


def test_one_rank_async_and_ssp_apply_exactly_what_sync_applies(secret):
    servers = [_train(secret, mode=mode) for mode in ("sync", "async", "ssp")]
    try:
        sync, *others = servers
        for other in others:  # one rank: nothing is ever stale, so every mode takes the same steps
            assert torch.allclose(other.parameters(), sync.parameters(), atol=1e-6)
            for name, rows in _rows(sync).items():
                assert torch.allclose(_rows(other)[name], rows, atol=1e-6)
    finally:
        for s in servers:
            s.close()


def test_two_rank_async_applies_every_push_once(secret):
    server = _train(secret, mode="async", world_size=2)
    try:
        stats = server.stats
        assert stats["sparse"]["pushes"] == 2 * 2 * STEPS and server.version == 2 * STEPS
        assert stats["sparse"]["tables"]["a"]["rows"] > 0
    finally:
        server.close()


def test_fp16_rows_halve_the_bytes_and_stay_close_to_fp32(secret):
    full, half = _train(secret, world_size=2), _train(secret, world_size=2, wire_dtype="fp16")
    try:
        f, h = full.stats["sparse"], half.stats["sparse"]
        assert h["bytes_sent"] * 2 == f["bytes_sent"]  # rows of the replies: exactly half
        assert h["bytes_received"] < f["bytes_received"]  # pushes: ids stay int64, gradients halve
        for name, rows in _rows(full).items():
            assert torch.allclose(_rows(half)[name], rows, atol=5e-3)
            assert not torch.equal(_rows(half)[name], rows)
    finally:
        full.close()
        half.close()


def test_a_checkpoint_resumes_the_rows_and_their_optimizer_state(secret, tmp_path):
    from pipeline.checkpoints import CheckpointStore

    straight = _train(secret, world_size=2, steps=6)
    first = _train(secret, world_size=2, steps=3, row_shards=4)
    store = CheckpointStore(str(tmp_path), 2)  # the run's checkpoint files: atomic, loaded weights-only
    store.load(store.save({"step": 3, "ps": first.state_dict()}))
    state = store.load(store.latest())["ps"]
    assert len(state["sparse"]["a"]["shards"]) == 4  # per table, per row shard
    first.close()
    resumed = make_server(_model(), secret, world_size=2, row_opt=RowOptimizerSpec("adagrad", lr=0.2), row_shards=3)
    try:
        resumed.load_state_dict(state)
        assert resumed.version == 3
        run_ranks(2, lambda rank: train_rank(resumed, secret, rank, 6, _model))
        assert torch.allclose(resumed.parameters(), straight.parameters(), atol=1e-6)
        for name, rows in _rows(straight).items():
            assert torch.allclose(_rows(resumed)[name], rows, atol=1e-6)
    finally:
        straight.close()
        resumed.close()
