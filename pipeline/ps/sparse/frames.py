"""The sparse frames' layout and the header checks made before a payload byte is read.

Every sparse request starts its payload with an 8-byte prefix ``<u32 table index, u32 dim>``::

    SPARSE_PULL  client -> server  step, dtype = the rows' wire dtype, count = n ids
                                   payload: prefix | n int64 ids (distinct, ascending)
    SPARSE_ROWS  server -> client  step = the version served, count = n, payload: n x dim rows
    SPARSE_PUSH  client -> server  step, dtype = the gradients' wire dtype, count = n ids
                                   payload: prefix | n int64 ids | n x dim summed row gradients

The header alone bounds the frame (``count`` <= ``MAX_IDS``, the length consistent with ``count`` and a
dim <= ``MAX_DIM``); the prefix is then read alone and held against the table (index, dim, dtype) before
the rest, so a receiver never reads more than the header promised for a table that exists.
"""
from __future__ import annotations

import struct

from pipeline.errors import ProtocolError

PREFIX = struct.Struct("<II")
MAX_IDS = 1 << 20  # distinct ids of one table in one step (a batch of 1M rows of one feature)
MAX_DIM = 4096
ROW_ITEMSIZE = {1: 4, 2: 2}  # DType.FLOAT32, DType.FLOAT16: the dtypes rows travel in


def check_header(kind: str, dtype: int, count: int, length: int) -> None:
    """ProtocolError unless a sparse header is self-consistent (``kind``: pull, rows or push)."""
    itemsize = ROW_ITEMSIZE.get(dtype)
    if itemsize is None:
        raise ProtocolError(f"sparse {kind} frame with dtype code {dtype}: rows travel as FLOAT32 or FLOAT16")
    if count > MAX_IDS:
        raise ProtocolError(f"sparse {kind} frame announces {count} ids, more than the {MAX_IDS} one frame may carry")
    if kind == "pull":
        if length != PREFIX.size + 8 * count:
            raise ProtocolError(f"SPARSE_PULL of {count} ids must be {PREFIX.size + 8 * count} bytes, got {length}")
        return
    body = length - (PREFIX.size + 8 * count if kind == "push" else 0)
    if body < 0 or (count and (body % (count * itemsize) or body // (count * itemsize) > MAX_DIM)) or \
            (not count and body):
        raise ProtocolError(f"sparse {kind} frame of {count} ids and {length} bytes does not hold whole rows "
                            f"of at most {MAX_DIM} {itemsize}-byte values")
