"""The server side of the sparse frames: one handler per message, registered in ``pipeline.ps.server.dispatch``.

A frame whose header is inconsistent never gets here (``frames.check_header`` fails it in
``decode_header``: a protocol error, the connection is dropped). A well-framed request that names a
table this server does not have, a dim or dtype that is not the table's, or ids that are negative, out
of range or not distinct and sorted is *rejected*: the rest of its payload is skipped (the header bounded
it), the rejection counted (``stats['sparse']['rejected_frames']`` and ``protocol_errors``) and answered
with an ERROR of kind ``protocol``, and the connection stays in step. Nothing of a rejected frame is
applied.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pipeline.errors import ProtocolError
from pipeline.ps.server.messages import PROTOCOL, Ack, Refusal
from pipeline.ps.transport.protocol import DType, Header, MsgType
from pipeline.ps.sparse.frames import PREFIX, ROW_ITEMSIZE
from pipeline.wire.deadline import deadline_after

logger = logging.getLogger(__name__)

WIRE_DTYPES = {"fp32": DType.FLOAT32, "fp16": DType.FLOAT16}
_TORCH = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16}


@dataclass(frozen=True)
class SparseRequest:
    step: int
    table: int = -1
    ids: Any = None  # np.ndarray int64
    grad: Any = None  # torch.Tensor fp32 [n, dim] (push only)
    dtype: DType = DType.FLOAT32
    rejected: Optional[str] = None


@dataclass(frozen=True)
class SparseRows:
    """SPARSE_ROWS at ``version``: the rows of a pull, sent in the request's dtype."""

    version: int
    rows: Any
    dtype: DType

    def send_to(self, ctx: Any, conn: Any) -> None:
        rows = self.rows.to(_TORCH[self.dtype]).contiguous().reshape(-1)
        payload = memoryview(rows.numpy()).cast("B")
        conn.channel.send(Header(MsgType.SPARSE_ROWS, conn.generation, conn.rank, self.version, self.dtype,
                                 len(self.rows), payload.nbytes), payload, timeout=ctx.step_timeout.seconds)
        ctx.sparse.counts["bytes_sent"] += payload.nbytes


def _read(ctx: Any, conn: Any, header: Header, push: bool) -> SparseRequest:
    store = ctx.sparse
    deadline = deadline_after(ctx.step_timeout)
    channel = conn.channel
    if store is None:
        raise ProtocolError(f"{header.type.name} frame, but this server keeps no sparse tables")
    prefix = bytearray(PREFIX.size)
    channel.recv_exact(memoryview(prefix), deadline)
    index, dim = PREFIX.unpack(prefix)
    rest = header.length - PREFIX.size
    store.counts["bytes_received"] += header.length
    n = header.count
    why = None
    if index >= len(store.tables):
        why = f"table index {index}, but this server has {len(store.tables)} sparse table(s)"
    else:
        spec = store.table(index).spec
        if dim != spec.dim:
            why = f"table {spec.name!r} is {spec.dim} wide, the frame says {dim}"
        elif header.dtype is not WIRE_DTYPES[store.wire_dtype]:
            why = f"table {spec.name!r} travels as {store.wire_dtype} (ps.sparse.wire_dtype), got {header.dtype.name}"
        elif push and rest != n * 8 + n * dim * ROW_ITEMSIZE[int(header.dtype)]:
            why = f"SPARSE_PUSH of {n} rows of {dim} does not match its {header.length} bytes"
    if why is not None:
        channel.skip(Header(header.type, header.generation, header.rank, header.step, header.dtype, 0, rest),
                     deadline)
        return SparseRequest(header.step, rejected=why)
    body = bytearray(rest)
    channel.recv_exact(memoryview(body), deadline)
    ids = np.frombuffer(body, dtype="<i8", count=n).astype(np.int64, copy=False)
    why = store.check_ids(index, ids)
    if why is not None:
        return SparseRequest(header.step, rejected=why)
    grad = None
    if push:
        grad = torch.frombuffer(body, dtype=_TORCH[header.dtype], offset=8 * n, count=n * dim) \
            if n else torch.empty(0, dtype=_TORCH[header.dtype])
        grad = grad.reshape(n, dim).to(torch.float32)
    return SparseRequest(header.step, index, ids, grad, header.dtype)


def _reject(ctx: Any, conn: Any, request: SparseRequest) -> None:
    if request.rejected is None:
        return
    with ctx.policy.core.cond:
        ctx.sparse.counts["rejected_frames"] += 1
    ctx.count_protocol_error()
    logger.warning("rank %s: sparse frame rejected: %s", conn.rank, request.rejected)
    raise Refusal(f"sparse frame rejected: {request.rejected}", kind=PROTOCOL)


def _refuse_if_unservable(ctx: Any, conn: Any) -> None:
    refusal = ctx.policy.refusal_locked(conn)
    if refusal is not None:
        raise Refusal(refusal)


class SparsePullHandler:
    waits = False
    ends_connection = False

    def read(self, ctx: Any, conn: Any, header: Header) -> SparseRequest:
        return _read(ctx, conn, header, push=False)

    def handle(self, ctx: Any, conn: Any, request: SparseRequest) -> SparseRows:
        _reject(ctx, conn, request)
        with ctx.policy.core.cond:
            _refuse_if_unservable(ctx, conn)
            version, rows = ctx.sparse.pull_locked(conn, request.table, request.step, request.ids)
        return SparseRows(version, rows, request.dtype)


class SparsePushHandler:
    waits = False
    ends_connection = False

    def read(self, ctx: Any, conn: Any, header: Header) -> SparseRequest:
        return _read(ctx, conn, header, push=True)

    def handle(self, ctx: Any, conn: Any, request: SparseRequest) -> Ack:
        _reject(ctx, conn, request)
        with ctx.policy.core.cond:
            _refuse_if_unservable(ctx, conn)
            ctx.sparse.push_locked(conn, request.table, request.step, request.ids, request.grad)
        return Ack(request.step)


SPARSE_HANDLERS = {MsgType.SPARSE_PULL: SparsePullHandler(), MsgType.SPARSE_PUSH: SparsePushHandler()}
