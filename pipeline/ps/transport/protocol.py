"""The parameter-server protocol: its message types and their validation, over the shared wire.

Framing, the HMAC handshake, socket options and deadlines are ``pipeline.wire``'s (shared with the
pipeline stage links); this module adds what only the parameter server speaks: the message types
(:class:`MsgType`, whose handshake codes are the wire's), which dtypes and sizes each may carry, and
the validation of a header against what this receiver expects (``max_elements``: the parameter count),
all before a payload byte is read. Tensor payloads are raw bytes viewed with ``torch.frombuffer``; JSON
payloads (metrics, errors) are capped at 1 MiB. It re-exports :class:`Header` and :class:`DType` from
``pipeline.wire.frames``, the vocabulary every PS frame is built from; everything else of the wire
(constants, HMAC, deadlines, sockets) is imported from ``pipeline.wire`` itself.

Header layout: the wire's standard 48-byte header (``pipeline.wire.frames``)::

    magic 4s | version u8 | type u8 | pad 2 | generation u32 | rank u32 | step i64 |
    dtype u8 | pad 7 | count u64 | length u64
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional

import torch

from pipeline.errors import PSError, ProtocolError
from pipeline.ps.sparse.frames import check_header as check_sparse_header
from pipeline.wire import frames as _frames
from pipeline.wire.frames import (
    MAC_SIZE,
    MAX_JSON_BYTES,
    NONCE_SIZE,
    Buffer,
    Control,
    DType,
    Header,
    decode_json,
    tensor_view,
    unpack_header,
)

__all__ = [
    # This protocol's own names.
    "Channel", "MsgType", "decode_header", "decode_tensor", "tensor_bytes", "DEFAULT_TENSOR_DTYPES",
    "DTYPE_OF_TORCH", "BUFFER_TYPES", "MAX_BUFFER_WORDS",
    "EMPTY_TYPES", "FIXED_SIZE_TYPES", "ITEMSIZE", "JSON_TYPES", "TENSOR_TYPES",
    "TORCH_DTYPES", "ServerInfo", "ShardInfo", "parse_welcome", "check_welcome", "MAX_SHARDS",
    # Re-exported from pipeline.wire.frames: what PS frames are built from.
    "DType", "Header",
]


class MsgType(IntEnum):
    """Message types. Direction is noted because each side rejects frames it should never receive."""

    CHALLENGE = int(Control.CHALLENGE)  # server -> client: 32-byte nonce
    AUTH = int(Control.AUTH)  # client -> server: HMAC-SHA256(secret, nonce | rank | generation)
    WELCOME = 3  # server -> client: JSON {num_params, version, world_size, generation}
    PULL = 4  # client -> server: step = minimum version wanted
    PARAMS = 5  # server -> client: tensor, step = version
    PUSH = 6  # client -> server: gradient tensor for `step`
    ACK = 7  # server -> client
    METRICS = 8  # client -> server: JSON dict
    FAIL = 9  # client -> server: JSON {error, log_tail}
    FINISH = 10  # client -> server
    ERROR = int(Control.ERROR)  # server -> client: JSON {error, kind}
    # client -> server: PUSH for `step` whose reply is the PARAMS a PULL(step + 1) would get (one round
    # trip per synchronous step instead of two; sync/average/ssp only). Refusals come back as ERROR.
    PUSH_PULL = 12
    # Buffers are model state (pipeline.models.state): client -> server, this rank's buffer words
    # (FLOAT32 frame, count = the server's buffer_words), answered with ACK; server -> client, the
    # merged buffers, the answer to PULL_BUFFERS (client -> server, empty).
    BUFFERS = 13
    PULL_BUFFERS = 14
    # Sparse embedding tables (pipeline.ps.sparse.frames has the layout): rows of distinct ids, their
    # summed gradients; SPARSE_PUSH is answered with ACK, SPARSE_PULL with SPARSE_ROWS.
    SPARSE_PULL = 15
    SPARSE_ROWS = 16
    SPARSE_PUSH = 17
    # Shared-memory rings for a worker on the server's host (pipeline.ps.transport.shm_offer): SHM_REQUEST
    # (client -> server, empty) is answered with SHM_OFFER (JSON), SHM_ATTACHED (client -> server, JSON
    # {attached}) with ACK.
    SHM_REQUEST = 18
    SHM_OFFER = 19
    SHM_ATTACHED = 20
    # server -> client, empty, step = version: the PARAMS of that version lie in the shared parameter page
    # the client mapped (pipeline.wire.shared_page; sync mode, a worker on the server's host).
    PARAMS_SHARED = 21
    # The allreduce rendezvous through the driver's server (pipeline.ps.server.meeting): client -> server, JSON
    # {offer}; server -> client, JSON {offers}, every rank's offer in rank order, once all have sent one.
    RENDEZVOUS = 22


# fp16/bf16/sparse are only accepted for compressed pushes.
ITEMSIZE: dict[DType, int] = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.SPARSE_F32: 8}
TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}
DTYPE_OF_TORCH: dict[torch.dtype, DType] = {v: k for k, v in TORCH_DTYPES.items()}
# What a receiver accepts today; widen this when a compressed mode lands.
DEFAULT_TENSOR_DTYPES = frozenset({DType.FLOAT32})

TENSOR_TYPES = frozenset({MsgType.PARAMS, MsgType.PUSH, MsgType.PUSH_PULL})
JSON_TYPES = frozenset({MsgType.WELCOME, MsgType.METRICS, MsgType.FAIL, MsgType.ERROR, MsgType.SHM_OFFER,
                        MsgType.SHM_ATTACHED, MsgType.RENDEZVOUS})
# Buffer frames: fp32 words whose exact count the receiver checks against its layout before reading;
# the header only caps them (buffers are small next to parameters; 64 MiB is far above any BatchNorm).
BUFFER_TYPES = frozenset({MsgType.BUFFERS})
MAX_BUFFER_WORDS = 1 << 24
# ps.shards' upper bound (config/schema.py): a WELCOME listing more is not from a shardline server.
MAX_SHARDS = 64
SPARSE_KINDS = {MsgType.SPARSE_PULL: "pull", MsgType.SPARSE_ROWS: "rows", MsgType.SPARSE_PUSH: "push"}
FIXED_SIZE_TYPES: dict[MsgType, int] = {MsgType.CHALLENGE: NONCE_SIZE, MsgType.AUTH: MAC_SIZE}
EMPTY_TYPES = frozenset({MsgType.PULL, MsgType.ACK, MsgType.FINISH, MsgType.PULL_BUFFERS, MsgType.SHM_REQUEST,
                         MsgType.PARAMS_SHARED})


def decode_header(
    data: Buffer,
    *,
    max_elements: int,
    tensor_dtypes: frozenset[DType] = DEFAULT_TENSOR_DTYPES,
) -> Header:
    """Parse and validate a header. ``max_elements`` caps tensor payloads (the parameter count).

    Everything that decides how many bytes to read next is checked here, so the caller may read
    exactly ``header.length`` bytes afterwards without further thought.
    """
    type_code, generation, rank, step, dtype_code, count, length = unpack_header(data)
    try:
        msg_type = MsgType(type_code)
    except ValueError:
        raise ProtocolError(f"unknown message type {type_code}") from None
    try:
        dtype = DType(dtype_code)
    except ValueError:
        raise ProtocolError(f"unknown dtype code {dtype_code} in {msg_type.name} frame") from None

    if msg_type in TENSOR_TYPES:
        if dtype not in tensor_dtypes:
            raise ProtocolError(
                f"dtype {dtype.name} is not accepted for {msg_type.name} "
                f"(accepted: {', '.join(sorted(d.name for d in tensor_dtypes))})"
            )
        if count > max_elements:
            raise ProtocolError(
                f"{msg_type.name} frame announces {count} elements, more than the {max_elements} "
                "parameters this connection expects"
            )
        if length != count * ITEMSIZE[dtype]:
            raise ProtocolError(
                f"{msg_type.name} payload length {length} != count {count} * itemsize "
                f"{ITEMSIZE[dtype]} ({dtype.name})"
            )
    elif msg_type in SPARSE_KINDS:
        check_sparse_header(SPARSE_KINDS[msg_type], dtype, count, length)
    elif msg_type in BUFFER_TYPES:
        if dtype is not DType.FLOAT32:
            raise ProtocolError(f"{msg_type.name} frames carry FLOAT32 words, got {dtype.name}")
        if count > MAX_BUFFER_WORDS or length != count * 4:
            raise ProtocolError(f"{msg_type.name} frame of {count} words / {length} bytes (at most "
                                f"{MAX_BUFFER_WORDS} words, 4 bytes each)")
    else:
        if dtype is not DType.NONE or count != 0:
            raise ProtocolError(f"{msg_type.name} frame must not carry a dtype or element count")
        if msg_type in FIXED_SIZE_TYPES:
            if length != FIXED_SIZE_TYPES[msg_type]:
                raise ProtocolError(
                    f"{msg_type.name} payload must be {FIXED_SIZE_TYPES[msg_type]} bytes, got {length}"
                )
        elif msg_type in JSON_TYPES:
            if length > MAX_JSON_BYTES:
                raise ProtocolError(
                    f"{msg_type.name} JSON payload of {length} bytes exceeds the {MAX_JSON_BYTES} byte cap"
                )
        elif length != 0:
            raise ProtocolError(f"{msg_type.name} frame must have an empty payload, got {length} bytes")
    return Header(msg_type, generation, rank, step, dtype, count, length)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU, contiguous, 1-D tensor of a dtype the PS wire has a code for."""
    if tensor.dtype not in DTYPE_OF_TORCH:
        raise PSError(f"tensor dtype {tensor.dtype} has no wire code")
    return tensor_view(tensor)


def decode_tensor(payload: Buffer, header: Header) -> torch.Tensor:
    """View a received tensor payload without copying. The tensor aliases ``payload``."""
    if header.type not in TENSOR_TYPES:
        raise ProtocolError(f"{header.type.name} frame carries no tensor")
    if header.count == 0:
        return torch.empty(0, dtype=TORCH_DTYPES[header.dtype])
    return torch.frombuffer(payload, dtype=TORCH_DTYPES[header.dtype], count=header.count)


@dataclass(frozen=True)
class ShardInfo:
    """One shard's address and the slice ``[start, end)`` of the flat parameters it owns."""

    host: str
    port: int
    start: int
    end: int


@dataclass(frozen=True)
class ServerInfo:
    """What the server announced in WELCOME. The consistency and compression settings come from the
    server so that driver and workers cannot disagree about them."""

    num_params: int
    version: int
    world_size: int
    mode: str = "sync"
    staleness: int = 0
    sync_every: int = 1
    clock: int = 0  # ssp/async: the next step this rank pushes
    compression: str = "none"
    topk_ratio: float = 0.01
    shards: tuple[ShardInfo, ...] = ()  # empty: one shard at the address connected to, [0, num_params)
    buffer_words: int = 0  # fp32 words of the model's buffers the server keeps (0: none, no buffer frames)
    sparse_shards: int = 1  # sparse tables' rows are hashed over shards [0, sparse_shards) (table.owner_of)


def parse_welcome(body: dict[str, Any]) -> ServerInfo:
    """A WELCOME payload as ServerInfo; anything malformed or implausible is a ProtocolError."""
    try:
        shards = tuple(ShardInfo(str(s["host"]), int(s["port"]), int(s["start"]), int(s["end"]))
                       for s in body.get("shards", ()))
        info = ServerInfo(int(body["num_params"]), int(body["version"]), int(body["world_size"]),
                          mode=str(body.get("mode", "sync")), staleness=int(body.get("staleness", 0)),
                          sync_every=int(body.get("sync_every", 1)), clock=int(body.get("clock", 0)),
                          compression=str(body.get("compression", "none")),
                          topk_ratio=float(body.get("topk_ratio", 0.01)), shards=shards,
                          buffer_words=int(body.get("buffer_words", 0)),
                          sparse_shards=int(body.get("sparse_shards", 1)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed WELCOME: {exc}") from None
    if info.num_params <= 0 or info.version < 0 or info.world_size <= 0 or \
            not 0 <= info.buffer_words <= MAX_BUFFER_WORDS or not 1 <= info.sparse_shards <= max(1, len(shards)):
        raise ProtocolError(f"implausible WELCOME: {info}")
    if shards:
        # The slices must tile [0, num_params) in order, or PARAMS would land in the wrong place.
        edges = [0] + [s.end for s in shards]
        if any(s.start != edges[i] or s.end <= s.start for i, s in enumerate(shards)) \
                or edges[-1] != info.num_params:
            raise ProtocolError(f"WELCOME announces shard ranges that do not tile [0, {info.num_params})")
    return info


def check_welcome(info: ServerInfo, *, expected_params: Optional[int],
                  expected_buffer_words: Optional[int] = None) -> ServerInfo:
    """A WELCOME held against the model this worker built itself, before anything is allocated from it:
    a server that lies about sizes (or a bug on either side) is refused, naming both numbers.

    ``expected_params``: the worker's own parameter count (None: not known yet, only the header caps
    apply). ``expected_buffer_words``: the fp32 words of its buffers; the server may keep none (0)."""
    if expected_params is not None and info.num_params != expected_params:
        raise ProtocolError(f"the parameter server announced {info.num_params} parameters but this worker's "
                            f"model has {expected_params}; refusing it (a different model, or not this job's "
                            "server)")
    if expected_buffer_words is not None and info.buffer_words not in (0, expected_buffer_words):
        raise ProtocolError(f"the parameter server announced {info.buffer_words} buffer words but this "
                            f"worker's model has {expected_buffer_words}; refusing it")
    if len(info.shards) > MAX_SHARDS:
        raise ProtocolError(f"WELCOME announces {len(info.shards)} shards, more than the {MAX_SHARDS} "
                            "ps.shards allows")
    return info


class Channel(_frames.Channel):
    """A wire Channel that validates every header as a PS frame (``max_elements``: the parameter count
    of this connection, 0 before the handshake) and sends and receives PS tensors and JSON."""

    # A worker's copy-on-write view of the shard's parameters (pipeline.wire.shared_page.PageView),
    # mapped at SHM_OFFER: where a PARAMS_SHARED reply's version lies. None: PARAMS carry their payload.
    params_page: Any = None

    def close(self) -> None:
        page, self.params_page = self.params_page, None
        if page is not None:
            page.close()
        super().close()

    def recv_header(self, deadline: Optional[float], *,
                    tensor_dtypes: frozenset[DType] = DEFAULT_TENSOR_DTYPES) -> Header:
        """Read and validate the next header; raises PeerClosedError on a clean EOF."""
        return decode_header(self.recv_header_bytes(deadline), max_elements=self.max_elements,
                             tensor_dtypes=tensor_dtypes)

    def recv_json(self, header: Header, deadline: Optional[float]) -> dict[str, Any]:
        """Read a JSON object payload (capped at MAX_JSON_BYTES by decode_header)."""
        if header.type not in JSON_TYPES:
            raise ProtocolError(f"{header.type.name} frame carries no JSON")
        return decode_json(self.recv_bytes(header, deadline), header.type)

    def send_tensor(self, msg_type: MsgType, tensor: torch.Tensor, *, generation: int, rank: int,
                    step: int, timeout: Optional[float]) -> None:
        view = tensor_bytes(tensor)
        header = Header(msg_type, generation, rank, step, DTYPE_OF_TORCH[tensor.dtype],
                        tensor.numel(), view.nbytes)
        self.send(header, view, timeout=timeout)
