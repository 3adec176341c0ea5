"""The frames of a pipeline stage link (``pipeline.parallel.link``): their own 48-byte header (magic
``SHPL``), validated, element cap included, before a payload byte is read or a buffer allocated.

Frame header (little-endian, 48 bytes)::

    magic 4s | version u8 | type u8 | dtype u8 | pad 1 | generation u32 | rank u32 | step i64 |
    micro u32 | rows u32 | cols u32 | pad 4 | length u64
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Optional, Union

import torch

from pipeline.errors import ProtocolError
from pipeline.wire.frames import HEADER_SIZE, U32_MAX, Channel, DType

LINK_MAGIC = b"SHPL"
LINK_VERSION = 1
LINK_HEADER = struct.Struct("<4sBBBxIIqIIIxxxxQ")
# Same size as the wire's standard header (the handshake's) so one Channel buffer and receive loop serve both.
assert LINK_HEADER.size == HEADER_SIZE


class LinkFrame(IntEnum):
    """Tensor frames on a stage link. ACTIVATION goes p -> p+1, ACTIVATION_GRAD goes p+1 -> p."""

    ACTIVATION = 1
    ACTIVATION_GRAD = 2


_WHAT = {LinkFrame.ACTIVATION: "activations", LinkFrame.ACTIVATION_GRAD: "activation gradients"}


@dataclass(frozen=True)
class LinkHeader:
    """One decoded, validated link frame header. Quacks like ``protocol.Header`` for ``Channel.send``."""

    type: LinkFrame
    generation: int
    rank: int
    step: int
    micro: int
    rows: int
    cols: int

    @property
    def count(self) -> int:
        return self.rows * self.cols

    @property
    def length(self) -> int:
        return self.count * 4

    def pack(self) -> bytes:
        for name in ("generation", "rank", "micro", "rows", "cols"):
            if not 0 <= getattr(self, name) <= U32_MAX:
                raise ProtocolError(f"link frame {name} {getattr(self, name)} does not fit an unsigned 32-bit field")
        if not -(2**63) <= self.step < 2**63:
            raise ProtocolError(f"step {self.step} does not fit a signed 64-bit field")
        return LINK_HEADER.pack(LINK_MAGIC, LINK_VERSION, int(self.type), int(DType.FLOAT32), self.generation,
                                self.rank, self.step, self.micro, self.rows, self.cols, self.length)


def decode_link_header(data: Union[bytes, bytearray, memoryview], *, max_elements: int) -> LinkHeader:
    """Parse and validate a link frame header; after it the caller may read exactly ``length`` bytes."""
    if len(data) != LINK_HEADER.size:
        raise ProtocolError(f"link frame header must be {LINK_HEADER.size} bytes, got {len(data)}")
    magic, version, type_code, dtype, generation, rank, step, micro, rows, cols, length = LINK_HEADER.unpack(data)
    if magic != LINK_MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} on a stage link (expected {LINK_MAGIC!r})")
    if version != LINK_VERSION:
        raise ProtocolError(f"stage link version {version} is not supported (this side speaks {LINK_VERSION}); "
                            "all stages must run the same shardline version")
    try:
        frame = LinkFrame(type_code)
    except ValueError:
        raise ProtocolError(f"unknown stage link frame type {type_code}") from None
    if dtype != DType.FLOAT32:
        raise ProtocolError(f"{frame.name} frame has dtype code {dtype}; stage links carry float32 only")
    if rows == 0 or cols == 0:
        raise ProtocolError(f"{frame.name} frame has an empty shape ({rows}, {cols})")
    count = rows * cols
    if count > max_elements:
        raise ProtocolError(
            f"{frame.name} frame announces shape ({rows}, {cols}) = {count} elements, more than the "
            f"{max_elements} this link accepts per frame"
        )
    if length != count * 4:
        raise ProtocolError(f"{frame.name} payload length {length} != {rows} * {cols} * 4")
    return LinkHeader(frame, generation, rank, step, micro, rows, cols)


class _LinkChannel(Channel):
    """A wire Channel (handshake frames, send path, byte counts) that also reads link frames."""

    def recv_link_header(self, deadline: Optional[float]) -> LinkHeader:
        self._recv_exact(self._header_view, deadline, frame_start=True)
        return decode_link_header(self._header_buf, max_elements=self.max_elements)

    def recv_link_payload(self, header: LinkHeader, deadline: Optional[float]) -> torch.Tensor:
        out = torch.empty((header.rows, header.cols), dtype=torch.float32)
        self._recv_exact(memoryview(out.numpy()).cast("B"), deadline, frame_start=False)
        return out
