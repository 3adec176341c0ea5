"""The request loop of one authenticated worker connection and its dispatch table: one handler per
message type (after Horovod's ``BasicService._handle`` and its request/response classes), each reading
its request type off the wire and returning its reply type (``messages``).

Why reading the *next* request has no deadline: a worker may legitimately compute for a long time, and
its liveness is judged by its peers' step deadlines, by the kernel closing a dead process's socket, by
TCP keepalive and by ``close()`` (which shuts sockets down and so wakes those reads). The payload of a
started frame does have a deadline. A drop before FINISH is a failure of that rank.
"""
from __future__ import annotations

import contextlib
import time
import logging
from typing import Any, ContextManager, Generic, Protocol, TypeVar

from pipeline.errors import ProtocolError
from pipeline.ps.modes.compression import Contribution
from pipeline.ps.transport.connection import RankConnection
from pipeline.ps.server.messages import (
    MAX_ERROR_CHARS,
    MAX_LOG_TAIL_CHARS,
    PROTOCOL,
    Ack,
    Buffers,
    BuffersRequest,
    FailRequest,
    FinishRequest,
    MetricsRequest,
    Params,
    PullBuffersRequest,
    PullRequest,
    PushPullRequest,
    PushRequest,
    Refusal,
    Reply,
)
from pipeline.ps.state.buffers import BufferStore
from pipeline.ps.server.meeting import MEETING_HANDLERS, Offers
from pipeline.ps.modes.policies import ConsistencyPolicy
from pipeline.ps.transport.protocol import DType, Header, MsgType
from pipeline.ps.transport.shm_offer import SHM_HANDLERS, ShmOffer, give_back
from pipeline.ps.sparse.handlers import SPARSE_HANDLERS, SparseRows
from pipeline.wire.deadline import Timeout, deadline_after
from pipeline.wire.frames import PeerClosedError
from pipeline.wire.handshake import send_refusal

logger = logging.getLogger(__name__)

R = TypeVar("R")


class RequestContext(Protocol):
    """What the handlers need of the shard that serves the connection (``shard.ShardServer``)."""

    @property
    def policy(self) -> ConsistencyPolicy: ...
    @property
    def step_timeout(self) -> Timeout: ...
    @property
    def shard_index(self) -> int: ...
    @property
    def num_params(self) -> int: ...
    @property
    def push_dtypes(self) -> frozenset[DType]: ...
    @property
    def buffers(self) -> BufferStore | None: ...
    @property
    def sparse(self) -> Any: ...  # pipeline.ps.sparse.store.SparseStore, or None
    @property
    def shared_memory_bytes(self) -> int: ...  # ps.shared_memory_mb's budget per shard; 0: none (ps.tls)
    def reserve_shared_memory(self, nbytes: int) -> bool: ...
    def release_shared_memory(self, nbytes: int) -> None: ...
    def params_page_offer(self) -> dict[str, Any] | None: ...  # sync mode: pipeline.wire.shared_page

    def in_flight(self) -> ContextManager[None]: ...
    def count_push_payload(self, nbytes: int) -> None: ...
    def count_protocol_error(self) -> None: ...
    def record_failure(self, conn: RankConnection, error: str, log_tail: str = "", *,
                       retryable: bool = True) -> None: ...
    def record_drop(self, conn: RankConnection, what: str) -> None: ...
    def report_metrics(self, rank: int, metrics: dict[str, Any]) -> None: ...
    def finish(self, conn: RankConnection) -> None: ...
    def send_params(self, conn: RankConnection, version: int) -> None: ...


class Handler(Generic[R]):
    """One message type: ``read`` its request (payload included), ``handle`` it into one reply."""

    # Step requests wait on peers; fail()/close() wake them and let them deliver their ERROR first.
    waits: bool = False
    ends_connection: bool = False

    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> R:
        raise NotImplementedError

    def handle(self, ctx: RequestContext, conn: RankConnection, request: R) -> Reply:
        raise NotImplementedError


def _read_contribution(ctx: RequestContext, conn: RankConnection, header: Header) -> Contribution:
    if header.dtype is not DType.SPARSE_F32 and header.count != ctx.num_params:
        raise ProtocolError(f"PUSH of {header.count} elements, the model has {ctx.num_params}")
    if ctx.policy.sums_in_place and header.dtype is not DType.SPARSE_F32:
        held = conn.channel.recv_in_place(header)  # its ring space is held until the request is answered
        if held is not None:
            ctx.count_push_payload(header.length)
            return Contribution.lying_in(held, header, ctx.num_params)
    payload = conn.channel.recv_into(header, conn.grad_buf, deadline_after(ctx.step_timeout))
    ctx.count_push_payload(header.length)
    return Contribution(payload, header, ctx.num_params)  # validates sparse indices


class PushHandler(Handler[PushRequest]):
    waits = True

    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> PushRequest:
        return PushRequest(header.step, _read_contribution(ctx, conn, header))

    def handle(self, ctx: RequestContext, conn: RankConnection, request: PushRequest) -> Reply:
        return Ack(ctx.policy.push(conn, request.step, request.contribution))


class PushPullHandler(Handler[PushPullRequest]):
    waits = True

    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> PushPullRequest:
        return PushPullRequest(header.step, _read_contribution(ctx, conn, header))

    def handle(self, ctx: RequestContext, conn: RankConnection, request: PushPullRequest) -> Reply:
        return Params(ctx.policy.push_pull(conn, request.step, request.contribution))


class PullHandler(Handler[PullRequest]):
    waits = True

    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> PullRequest:
        return PullRequest(header.step)

    def handle(self, ctx: RequestContext, conn: RankConnection, request: PullRequest) -> Reply:
        return Params(ctx.policy.pull(conn, request.wanted))


class MetricsHandler(Handler[MetricsRequest]):
    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> MetricsRequest:
        return MetricsRequest(header.step, conn.channel.recv_json(header, deadline_after(ctx.step_timeout)))

    def handle(self, ctx: RequestContext, conn: RankConnection, request: MetricsRequest) -> Reply:
        ctx.report_metrics(conn.rank, request.metrics)
        return Ack(request.step)


class FailHandler(Handler[FailRequest]):
    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> FailRequest:
        body = conn.channel.recv_json(header, deadline_after(ctx.step_timeout))
        # Only a JSON false says "do not retry"; absent (an older worker) or anything else: retryable.
        retryable = body.get("retryable", True)
        return FailRequest(header.step, str(body.get("error", "worker reported a failure"))[:MAX_ERROR_CHARS],
                           str(body.get("log_tail", ""))[-MAX_LOG_TAIL_CHARS:],
                           retryable=retryable if isinstance(retryable, bool) else True)

    def handle(self, ctx: RequestContext, conn: RankConnection, request: FailRequest) -> Reply:
        ctx.record_failure(conn, request.error, request.log_tail, retryable=request.retryable)
        return Ack(request.step)


class FinishHandler(Handler[FinishRequest]):
    ends_connection = True

    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> FinishRequest:
        return FinishRequest(header.step)

    def handle(self, ctx: RequestContext, conn: RankConnection, request: FinishRequest) -> Reply:
        ctx.finish(conn)
        return Ack(request.step)


def _buffer_store(ctx: RequestContext, what: str) -> BufferStore:
    if ctx.buffers is None:
        raise ProtocolError(f"{what} frame, but this server keeps no model buffers (the model has none, or "
                            "this is not shard 0)")
    return ctx.buffers


class BuffersHandler(Handler[BuffersRequest]):
    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> BuffersRequest:
        import torch

        store = _buffer_store(ctx, "BUFFERS")
        if header.count != store.words:  # checked before a payload byte is read
            raise ProtocolError(f"BUFFERS of {header.count} words, the model's buffers take {store.words}")
        payload = bytearray(conn.channel.recv_bytes(header, deadline_after(ctx.step_timeout)))
        return BuffersRequest(header.step, torch.frombuffer(payload, dtype=torch.float32, count=header.count)
                              if header.count else torch.empty(0))

    def handle(self, ctx: RequestContext, conn: RankConnection, request: BuffersRequest) -> Reply:
        if conn.superseded:  # cut by a new attempt: its buffers must not outlive the fold into the base
            raise Refusal(f"generation {conn.generation} was superseded; its buffers are discarded")
        _buffer_store(ctx, "BUFFERS").report(conn.rank, request.words)
        return Ack(request.step)


class PullBuffersHandler(Handler[PullBuffersRequest]):
    def read(self, ctx: RequestContext, conn: RankConnection, header: Header) -> PullBuffersRequest:
        _buffer_store(ctx, "PULL_BUFFERS")
        return PullBuffersRequest(header.step)

    def handle(self, ctx: RequestContext, conn: RankConnection, request: PullBuffersRequest) -> Reply:
        return Buffers(request.step, _buffer_store(ctx, "PULL_BUFFERS").start())


# Frames a worker may send after the handshake; any other type is a protocol error.
HANDLERS: dict[MsgType, Handler[Any]] = {
    MsgType.PUSH: PushHandler(),
    MsgType.PUSH_PULL: PushPullHandler(),
    MsgType.PULL: PullHandler(),
    MsgType.METRICS: MetricsHandler(),
    MsgType.FAIL: FailHandler(),
    MsgType.FINISH: FinishHandler(),
    MsgType.BUFFERS: BuffersHandler(),
    MsgType.PULL_BUFFERS: PullBuffersHandler(),
    **SPARSE_HANDLERS,  # SPARSE_PULL, SPARSE_PUSH (pipeline.ps.sparse.handlers)
    **SHM_HANDLERS,  # SHM_REQUEST, SHM_ATTACHED (pipeline.ps.transport.shm_offer)
    **MEETING_HANDLERS,  # RENDEZVOUS (pipeline.ps.server.meeting)
}


def deliver(ctx: RequestContext, conn: RankConnection, reply: Reply) -> None:
    if isinstance(reply, (SparseRows, ShmOffer, Offers)):
        reply.send_to(ctx, conn)
        return
    match reply:
        case Params(version=version):
            ctx.send_params(conn, version)
        case Buffers(step=step, words=words):
            conn.channel.send_tensor(MsgType.BUFFERS, words, generation=conn.generation, rank=conn.rank,
                                     step=step, timeout=ctx.step_timeout.seconds)
        case Ack(step=step):
            conn.channel.send_empty(MsgType.ACK, generation=conn.generation, rank=conn.rank, step=step,
                                    timeout=ctx.step_timeout.seconds)
        case _:
            raise TypeError(f"a handler returned {reply!r}, which is no reply type")


def serve_request(ctx: RequestContext, conn: RankConnection, header: Header) -> bool:
    """Read, handle and answer one request; True when the connection is done (FINISH)."""
    handler = HANDLERS.get(header.type)
    if handler is None:
        raise ProtocolError(f"unexpected {header.type.name} frame from a worker")
    request = handler.read(ctx, conn, header)
    with ctx.in_flight() if handler.waits else contextlib.nullcontext():
        try:
            deliver(ctx, conn, handler.handle(ctx, conn, request))
        except Refusal as refusal:
            send_refusal(conn.channel, str(refusal), kind=refusal.kind, generation=conn.generation,
                         rank=conn.rank, step=header.step, timeout=ctx.step_timeout.seconds)
        finally:
            conn.channel.drop_in_place()  # a push read in place (_read_contribution) is summed by now
    return handler.ends_connection


def serve_requests(ctx: RequestContext, conn: RankConnection, peer: tuple) -> None:
    """The request loop of one authenticated worker, until FINISH or the connection ends."""
    try:
        _serve_requests(ctx, conn, peer)
    finally:
        give_back(ctx, conn)  # the rings go with the channel, closed right after this loop


def _serve_requests(ctx: RequestContext, conn: RankConnection, peer: tuple) -> None:
    channel = conn.channel
    while True:
        try:
            header = channel.recv_header(None, tensor_dtypes=ctx.push_dtypes)  # idle: no deadline
            conn.heard_at, conn.in_request = time.monotonic(), True
            if header.generation != conn.generation or header.rank != conn.rank:
                raise ProtocolError(
                    f"frame for rank {header.rank} generation {header.generation} on the connection "
                    f"of rank {conn.rank} generation {conn.generation}")
            if serve_request(ctx, conn, header):
                return
            conn.heard_at, conn.in_request = time.monotonic(), False
        except PeerClosedError:
            ctx.record_drop(conn, "closed its connection to the parameter server before FINISH")
            return
        except ProtocolError as exc:
            logger.warning("protocol error from rank %s (%s): %s", conn.rank, peer, exc)
            ctx.count_protocol_error()
            send_refusal(channel, f"protocol error: {exc}", kind=PROTOCOL, generation=conn.generation,
                         rank=conn.rank, timeout=ctx.step_timeout.seconds)
            ctx.record_drop(conn, f"sent a malformed frame and was disconnected: {exc}")
            return
        except TimeoutError:
            ctx.record_drop(conn, f"stalled mid-frame for more than {ctx.step_timeout.seconds:g}s "
                                  f"({ctx.step_timeout.key})")
            return
        except OSError as exc:
            ctx.record_drop(conn, f"lost its connection to the parameter server: {exc}")
            return
