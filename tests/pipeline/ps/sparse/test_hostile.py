"""Hostile sparse frames: rejected before anything is applied, counted, answered with an ERROR; the
connection (or, for a frame whose header lies, the server) stays up and training goes on."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from pipeline.errors import PSError
from pipeline.ps.transport.protocol import DType, Header, MsgType
from pipeline.ps.sparse.frames import MAX_IDS, PREFIX
from pipeline.ps.sparse.rowopt import RowOptimizerSpec
from pipeline.wire.deadline import deadline_after
from tests.pipeline.ps.sparse.helpers import DIM, ROWS, TwoTables, make_server, run_ranks, train_rank
from tests.pipeline.ps.transport.test_wire_fuzz import wait_until

STEPS = 4


def _model() -> TwoTables:
    torch.manual_seed(0)
    return TwoTables()


def _frame(msg: MsgType, ids, *, index=0, dim=DIM, dtype=DType.FLOAT32, rows: bytes | None = None) -> tuple:
    ids = np.asarray(ids, dtype="<i8")
    payload = PREFIX.pack(index, dim) + ids.tobytes() + (rows or b"")
    return msg, dtype, len(ids), payload


GARBAGE = {
    "unknown table": _frame(MsgType.SPARSE_PULL, [1, 2], index=7),
    "negative id": _frame(MsgType.SPARSE_PULL, [-5, 2]),
    "out of range": _frame(MsgType.SPARSE_PULL, [3, ROWS]),
    "not distinct": _frame(MsgType.SPARSE_PULL, [4, 4]),
    "wrong dim": _frame(MsgType.SPARSE_PUSH, [1, 2], dim=DIM + 1, rows=bytes(2 * (DIM + 1) * 4)),
    "wrong dtype": _frame(MsgType.SPARSE_PUSH, [1, 2], dtype=DType.FLOAT16, rows=bytes(2 * DIM * 2)),
    "nan rows": _frame(MsgType.SPARSE_PUSH, [1, 2], rows=struct.pack("<f", float("nan")) * (2 * DIM)),
}


def _send_garbage(client, step: int) -> None:
    if step != 2:
        return
    channel = client._links[0].channel
    for what, (msg, dtype, count, payload) in GARBAGE.items():
        channel.send(Header(msg, client.generation, client.rank, step, dtype, count, len(payload)), payload,
                     timeout=2.0)
        header = channel.recv_header(deadline_after(client.step_timeout))
        assert header.type is MsgType.ERROR, what
        body = channel.recv_json(header, deadline_after(client.step_timeout))
        assert body["kind"] == ("nonfinite" if what == "nan rows" else "protocol"), (what, body)


def test_rejected_frames_are_counted_and_training_goes_on(secret):
    clean = make_server(_model(), secret, world_size=2, row_opt=RowOptimizerSpec("sgd", lr=0.2))
    hostile = make_server(_model(), secret, world_size=2, row_opt=RowOptimizerSpec("sgd", lr=0.2))
    try:
        run_ranks(2, lambda rank: train_rank(clean, secret, rank, STEPS, _model))
        run_ranks(2, lambda rank: train_rank(hostile, secret, rank, STEPS, _model,
                                             before_step=_send_garbage if rank == 0 else None))
        stats = hostile.stats
        assert stats["sparse"]["rejected_frames"] == len(GARBAGE) - 1  # the NaN push was read, then refused
        assert stats["protocol_errors"] == len(GARBAGE) - 1
        assert hostile.failures == {}
        # Nothing of a rejected frame was applied: the same numbers as the clean run.
        assert torch.equal(hostile.parameters(), clean.parameters())
        for name in ("a", "b"):
            got = hostile.state_dict()["sparse"][name]["shards"]
            want = clean.state_dict()["sparse"][name]["shards"]
            assert all(torch.equal(g["rows"], w["rows"]) for g, w in zip(got, want))
    finally:
        clean.close()
        hostile.close()


def test_a_header_over_the_cap_drops_that_connection_and_the_server_trains_on(secret):
    server = make_server(_model(), secret, world_size=1, row_opt=RowOptimizerSpec("sgd", lr=0.2))
    try:
        def liar(client, step):
            if step == 1:  # more ids than any frame may carry: refused from the header alone, payload unread
                client._links[0].channel.sock.sendall(Header(
                    MsgType.SPARSE_PULL, client.generation, client.rank, step, DType.FLOAT32, MAX_IDS + 1,
                    8 + 8 * (MAX_IDS + 1)).pack())

        with pytest.raises(PSError, match="more than the 1048576 one frame may carry"):
            train_rank(server, secret, 0, 3, _model, before_step=liar)
        # The client sees the refusal before the server has finished recording it: wait for the record.
        wait_until(lambda: server.aborted, "the server to abort the attempt after the oversized header")
        assert server.stats["protocol_errors"] == 1
        generation = server.new_generation()  # the retry of the attempt: the same server trains on
        train_rank(server, secret, 0, 3, _model, generation=generation)
        assert server.version == 3 and server.stats["sparse"]["pushes"] == 2 * 3
    finally:
        server.close()


@pytest.mark.parametrize("msg, dtype, count, length, reason", [
    (MsgType.SPARSE_PULL, DType.NONE, 1, 16, "rows travel as FLOAT32 or FLOAT16"),
    (MsgType.SPARSE_PULL, DType.FLOAT32, 2, 16, "must be 24 bytes, got 16"),
    (MsgType.SPARSE_PUSH, DType.FLOAT32, 2, 8 + 16 + 2 * 3 * 4 + 1, "does not hold whole rows"),
    (MsgType.SPARSE_PUSH, DType.FLOAT16, 1, 8 + 8 + 2 * 5000, "does not hold whole rows of at most 4096"),
    (MsgType.SPARSE_ROWS, DType.FLOAT32, 0, 4, "does not hold whole rows"),
    (MsgType.SPARSE_PUSH, DType.FLOAT32, 2**40, 0, "more than the 1048576"),
])
def test_inconsistent_sparse_headers_fail_before_any_payload_is_read(msg, dtype, count, length, reason):
    from pipeline.errors import ProtocolError
    from pipeline.ps.transport.protocol import decode_header

    with pytest.raises(ProtocolError, match=reason):
        decode_header(Header(msg, 1, 0, 0, dtype, count, length).pack(), max_elements=10)
