"""Push compression (``ps.compression``): what a worker puts on the wire and how the server adds it up.

Why only pushes are compressed: the server accumulates and steps in fp32 and workers must all start
each step from the same exact parameters, so PARAMS stay fp32. Pushes are where the volume scales
with the number of workers.

* ``fp16``/``bf16``: one preallocated half-precision buffer, one ``copy_`` per push (half the bytes);
  the server adds the half tensor into its fp32 sum (dtype promotion, no intermediate copy).
* ``topk``: the ``ceil(ratio * n)`` largest-magnitude entries of ``gradient + residual`` go out as
  int32 indices + fp32 values (``DType.SPARSE_F32``); what was not sent stays in the worker's residual
  (error feedback) and is sent once it has grown large enough, so no gradient mass is lost.

Indices from the network are range-checked before they touch server memory.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from pipeline.errors import PSError, ProtocolError
from pipeline.ps.transport.protocol import DType, Header, tensor_bytes

logger = logging.getLogger(__name__)

COMPRESSIONS = ("none", "fp16", "bf16", "topk")
COMPRESSION_KEY = "ps.compression"
RATIO_KEY = "ps.topk_ratio"

_WIRE_DTYPE: dict[str, DType] = {"none": DType.FLOAT32, "fp16": DType.FLOAT16, "bf16": DType.BFLOAT16,
                                 "topk": DType.SPARSE_F32}


def wire_dtype(compression: str) -> DType:
    """The one push dtype a server with this compression accepts (so byte counts cannot be dodged)."""
    try:
        return _WIRE_DTYPE[compression]
    except KeyError:
        raise PSError(f"{COMPRESSION_KEY}: {compression!r} is not one of {', '.join(COMPRESSIONS)}") from None


def topk_count(num_params: int, ratio: float) -> int:
    """How many entries a top-k push carries: at least one, at most all."""
    if not 0 < ratio <= 1:
        raise PSError(f"{RATIO_KEY} must be in (0, 1], got {ratio}")
    return max(1, min(num_params, math.ceil(ratio * num_params)))


@dataclass(frozen=True)
class Encoded:
    """One encoded push: the bytes to send and the header fields that describe them."""

    payload: memoryview
    dtype: DType
    count: int


class Compressor:
    """Worker-side encoder of one flat fp32 vector per push. Owns its buffers (and the top-k
    residual), so a push allocates nothing; the returned payload is valid until the next encode."""

    def __init__(self, compression: str, num_params: int, ratio: float = 0.01) -> None:
        self.compression = compression
        self.num_params = num_params
        self.dtype = wire_dtype(compression)
        self._half: torch.Tensor | None = None
        self._residual: torch.Tensor | None = None
        self._sparse: torch.Tensor | None = None
        self.k = num_params
        if compression in ("fp16", "bf16"):
            self._half = torch.empty(num_params, dtype=torch.float16 if compression == "fp16" else torch.bfloat16)
        elif compression == "topk":
            self.k = topk_count(num_params, ratio)
            self._residual = torch.zeros(num_params, dtype=torch.float32)
            self._sparse = torch.empty(2 * self.k, dtype=torch.int32)  # k indices, then k fp32 bit patterns

    @property
    def residual(self) -> torch.Tensor | None:
        """The error-feedback residual (top-k only): what has been computed but not yet sent."""
        return self._residual

    def encode(self, flat: torch.Tensor) -> Encoded:
        if flat.numel() != self.num_params:
            raise PSError(f"compressor for {self.num_params} values got {flat.numel()}")
        if self.compression == "none":
            return Encoded(tensor_bytes(flat), DType.FLOAT32, self.num_params)
        if self._half is not None:
            self._half.copy_(flat)
            return Encoded(tensor_bytes(self._half), self.dtype, self.num_params)
        assert self._residual is not None and self._sparse is not None
        acc = self._residual.add_(flat)  # gradient + what earlier pushes left behind
        _, idx = acc.abs().topk(self.k, sorted=False)
        k = self.k
        self._sparse[:k].copy_(idx)
        self._sparse[k:].view(torch.float32).copy_(acc[idx])
        acc[idx] = 0.0  # sent: only the rest stays as residual
        return Encoded(memoryview(self._sparse.numpy()).cast("B"), DType.SPARSE_F32, k)


def all_finite(t: torch.Tensor) -> bool:
    """Exact NaN/Inf check at the cost of a sum: NaN/Inf always propagate into the sum, and only
    an overflowing sum of finite values (vanishingly rare) pays for the elementwise check, which
    is ~10x slower than a sum on CPU."""
    return math.isfinite(float(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


_DENSE = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}


class Contribution:
    """Server-side view of one received push (aliases the receive buffer: use it before the next).

    ``in_place``: a dense push read where it lies in the connection's shared-memory ring, which its
    sender can still write: checking it and then summing it would let a local rank change it in between,
    so a policy sums it first and checks the sum, its own memory (``SyncPolicy.push``)."""

    in_place = False

    def __init__(self, payload: memoryview, header: Header, num_params: int) -> None:
        self.header = header
        self.indices: torch.Tensor | None = None
        if header.dtype is DType.SPARSE_F32:
            k = header.count
            words = torch.frombuffer(payload, dtype=torch.int32, count=2 * k) if k else torch.empty(0, dtype=torch.int32)
            self.indices = words[:k]
            self.values = words[k:].view(torch.float32)
            if k and (int(self.indices.min()) < 0 or int(self.indices.max()) >= num_params):
                raise ProtocolError(f"top-k PUSH carries an index outside [0, {num_params})")
        else:
            if header.count != num_params:
                raise ProtocolError(f"PUSH of {header.count} elements, the model has {num_params}")
            self.values = torch.frombuffer(payload, dtype=_DENSE[header.dtype], count=num_params)

    @classmethod
    def lying_in(cls, data: torch.Tensor, header: Header, num_params: int) -> Contribution:
        """A dense push over ``data`` (its bytes in place, 64-byte aligned: ``Channel.recv_in_place``)."""
        if header.dtype is DType.SPARSE_F32:  # indices validated once could change after: never in place
            raise ProtocolError("a sparse PUSH is never read in place")
        contribution = cls.__new__(cls)
        contribution.header, contribution.indices, contribution.in_place = header, None, True
        if header.count != num_params:
            raise ProtocolError(f"PUSH of {header.count} elements, the model has {num_params}")
        contribution.values = data.view(_DENSE[header.dtype])
        return contribution

    def all_finite(self) -> bool:
        return all_finite(self.values)

    def start_sum(self, target: torch.Tensor) -> None:
        """Overwrite ``target`` with ``0 + this push``, bit for bit what ``target.zero_()`` then
        ``add_to(target)`` gives (``x + 0.0`` also turns -0.0 into +0.0), in one pass instead of two."""
        if self.indices is None:
            torch.add(self.values, 0.0, out=target)
        else:
            target.zero_()
            self.add_to(target)

    def add_to(self, target: torch.Tensor, alpha: float = 1.0) -> None:
        """Accumulate ``alpha *`` this push into an fp32 buffer (dense: promoted add; sparse: index_add,
        duplicates sum)."""
        if self.indices is None:
            target.add_(self.values, alpha=alpha)
        else:
            target.index_add_(0, self.indices.long(), self.values, alpha=alpha)
