"""Setting up a connection's shared-memory rings (``ps.shared_memory_mb``, ``pipeline.wire.shm``): two
requests a worker sends once, right after the WELCOME, and their handlers (registered in
``pipeline.ps.server.dispatch``).

A WELCOME says ``shared_memory: true`` when rings are possible for the connection (the worker connected
from this connection's own local address, and the server's settings allow them). Only then does the
worker send SHM_REQUEST (empty), answered with SHM_OFFER: a segment's name, ring size and token, or a
reason why not. The worker maps the segment and says so with SHM_ATTACHED (``{attached: bool}``), answered with ACK; the server unlinks the file either
way, so none is left behind, and from then on each end writes large payloads into its ring. A worker on
another host (or in a container with another /dev/shm) declines and that connection stays on plain TCP.

The offer also holds, where they apply: the size of a gradient slot (uncompressed sync/ssp/async
pushes: the worker computes its gradient there, ``PSClient.grad_slot``), and in sync mode the shard's
parameter page (``pipeline.wire.shared_page``: ``page``, ``page_bytes``, ``page_token``). A worker that
maps the page says ``page: true`` in SHM_ATTACHED, and its PARAMS replies become PARAMS_SHARED headers.

Why the worker asks and the server offers: the server knows the slice the rings must hold and whether
its own settings allow them (never with ``ps.tls``); a segment reserved for a remote worker would only cost
/dev/shm memory on the driver, so one is created only for a peer on this host.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from pipeline.errors import ProtocolError
from pipeline.ps.server.messages import Ack, Refusal
from pipeline.ps.transport.protocol import Channel, DType, Header, MsgType
from pipeline.wire import shared_page, shm
from pipeline.wire.deadline import deadline_after, remaining

logger = logging.getLogger(__name__)

# Above the slice's own bytes: room for the buffers and sparse frames of a step next to it.
SLACK_BYTES = 256 * 1024
# Slices in the server->worker ring when PARAMS come through it: a worker keeps the PARAMS it trains on
# where they lie in the ring until the next PARAMS arrives (``Channel.recv_in_place``), so the next one
# needs room of its own beside it. With the shared parameter page (sync mode) PARAMS never do: one slice
# is room enough for what else comes back (sparse rows, a worker that could not map the page). Pushes
# are held only while their request is served, so the worker->server ring holds one slice.
SLICES_PER_RING = 2


@dataclass(frozen=True)
class ShmRequest:
    step: int


@dataclass(frozen=True)
class ShmAttached:
    step: int
    attached: bool
    page: bool  # the worker also mapped the shared parameter page (pipeline.wire.shared_page)


@dataclass(frozen=True)
class ShmOffer:
    """SHM_OFFER: the offer's JSON (``{"name", "ring_bytes", "reply_ring_bytes", "slot_bytes", "token"}``
    and the page's keys, or ``{"declined": why}``)."""

    step: int
    body: dict[str, Any]

    def send_to(self, ctx: Any, conn: Any) -> None:
        conn.channel.send_json(MsgType.SHM_OFFER, self.body, generation=conn.generation, rank=conn.rank,
                               step=self.step, timeout=ctx.step_timeout.seconds)


def _declined(channel: Channel, cap_bytes: int) -> Optional[str]:
    if cap_bytes <= 0:
        return "off on this server (ps.shared_memory_mb: 0, or ps.tls)"
    if not shm.supported():
        return "not supported on this host (x86-64 Linux with /dev/shm only)"
    try:
        local, peer = channel.sock.getsockname()[0], channel.sock.getpeername()[0]
    except OSError as exc:
        return f"no socket address: {exc}"
    if peer != local:
        return f"the worker connected from {peer}, not from this host's {local}"
    return None


def rings_possible(channel: Channel, cap_bytes: int) -> bool:
    """What the WELCOME's ``shared_memory`` says: worth a SHM_REQUEST (a worker asks only then)."""
    return _declined(channel, cap_bytes) is None


class ShmRequestHandler:
    waits = False
    ends_connection = False

    def read(self, ctx: Any, conn: Any, header: Header) -> ShmRequest:
        return ShmRequest(header.step)

    def handle(self, ctx: Any, conn: Any, request: ShmRequest) -> ShmOffer:
        if conn.channel.shm is not None or conn.shm_offer is not None:
            raise Refusal("shared memory was already offered on this connection")
        reason = _declined(conn.channel, ctx.shared_memory_bytes)
        page = ctx.params_page_offer()
        ring = 4 * ctx.num_params + SLACK_BYTES
        reply = (1 if page else SLICES_PER_RING) * 4 * ctx.num_params + SLACK_BYTES
        # Uncompressed gradient pushes: a slot the worker's autograd writes into (pipeline.wire.shm).
        slot = 4 * ctx.num_params if ctx.policy.mode != "average" and ctx.push_dtypes == {DType.FLOAT32} else 0
        held = ring + reply + slot
        if reason is None and not ctx.reserve_shared_memory(held):
            reason = (f"the shard's ps.shared_memory_mb budget ({ctx.shared_memory_bytes >> 20} MB) is taken by "
                      "other connections' rings")
            logger.info("rank %s stays on TCP: %s", conn.rank, reason)
        elif reason is None:
            try:
                link, body = shm.create(ring, slot, reply)
            except OSError as exc:
                ctx.release_shared_memory(held)
                logger.warning("rank %s: no shared memory for its connection (%s); it stays on TCP: give "
                               "/dev/shm more room or lower ps.shared_memory_mb", conn.rank, exc)
                reason = f"/dev/shm could not hold the rings: {exc}"
            else:
                conn.shm_offer, conn.shm_reserved = link, held
                return ShmOffer(request.step, {**body, **(page or {})})
        return ShmOffer(request.step, {"declined": reason})


class ShmAttachedHandler:
    waits = False
    ends_connection = False

    def read(self, ctx: Any, conn: Any, header: Header) -> ShmAttached:
        body = conn.channel.recv_json(header, deadline_after(ctx.step_timeout))
        return ShmAttached(header.step, body.get("attached") is True, body.get("page") is True)

    def handle(self, ctx: Any, conn: Any, request: ShmAttached) -> Ack:
        if conn.shm_offer is None:
            raise ProtocolError("SHM_ATTACHED without a shared-memory offer")
        if not request.attached:  # the worker could not map it: the segment and its budget go now
            give_back(ctx, conn)
            return Ack(request.step)
        link, conn.shm_offer = conn.shm_offer, None
        shm.unlink(link)
        conn.channel.shm = link
        conn.params_in_page = request.page and ctx.params_page_offer() is not None
        return Ack(request.step)


SHM_HANDLERS = {MsgType.SHM_REQUEST: ShmRequestHandler(), MsgType.SHM_ATTACHED: ShmAttachedHandler()}


def give_back(ctx: Any, conn: Any) -> None:
    """The connection's unanswered offer removed (its segment unlinked) and its share of the shard's budget
    returned: a declined offer, or the connection's end (its rings go with the channel)."""
    link, conn.shm_offer = conn.shm_offer, None
    if link is not None:
        shm.unlink(link)
        link.close()
    if conn.shm_reserved:
        ctx.release_shared_memory(conn.shm_reserved)
        conn.shm_reserved = 0


def request_rings(channel: Channel, *, rank: int, generation: int, deadline: Optional[float]) -> None:
    """The worker's side, once per connection after its WELCOME: ask, map what is offered (or decline),
    and wait for the ACK. The channel uses the rings from then on, or stays on TCP."""
    channel.send_empty(MsgType.SHM_REQUEST, generation=generation, rank=rank, timeout=remaining(deadline))
    header = channel.recv_header(deadline)
    if header.type is not MsgType.SHM_OFFER:
        raise ProtocolError(f"expected SHM_OFFER, got {header.type.name}")
    body = channel.recv_json(header, deadline)
    if "declined" in body:
        logger.debug("rank %s: no shared memory with the parameter server: %s", rank, body["declined"])
        return
    link, reason, page = None, "", None
    try:
        link = shm.attach(body)
    except (OSError, ValueError) as exc:
        reason = str(exc)
        logger.info("rank %s: the parameter server's shared memory is not reachable from here (%s); this "
                    "connection stays on TCP", rank, reason)
    if link is not None and "page" in body:
        try:
            page = shared_page.attach(body)
        except (OSError, ValueError) as exc:  # e.g. another PID namespace: PARAMS come through the ring
            logger.info("rank %s: the parameter server's shared parameter page is not reachable from here "
                        "(%s); its PARAMS come as copies", rank, exc)
    try:
        channel.send_json(MsgType.SHM_ATTACHED, {"attached": link is not None, "page": page is not None,
                                                 "reason": reason[:200]},
                          generation=generation, rank=rank, timeout=remaining(deadline))
        header = channel.recv_header(deadline)
        if header.type is not MsgType.ACK:
            raise ProtocolError(f"expected the ACK of SHM_ATTACHED, got {header.type.name}")
    except BaseException:
        for held in (link, page):
            if held is not None:
                held.close()
        raise
    channel.shm, channel.params_page = link, page


def page_params(channel: Channel, size: int, shard: int) -> Any:
    """The worker's side of a PARAMS_SHARED reply: the shard's parameter page (``pipeline.wire.shared_page``,
    an fp32 tensor of ``size`` values) that holds the version the reply names, without this worker's own
    writes (``PageView.refresh``)."""
    page = channel.params_page
    if page is None or page.tensor.numel() != size:
        raise ProtocolError(f"PARAMS_SHARED from shard {shard}, which offered no shared parameter page of its "
                            f"{size} parameters")
    channel.drop_in_place()  # a PARAMS held in the ring before is no longer the one in use
    page.refresh()
    return page.tensor
