"""The allreduce rendezvous through the driver's parameter server (RENDEZVOUS), both ends.

Every rank of a generation sends shard 0 what it offers its allreduce group — the kind of device it trains
on and, from the group's first rank, the address of the authenticated store the group meets at
(``pipeline.worker.store``) — and gets every rank's offer back, in rank order, once all have sent one.

Why not the barrier's ``allGather``, as a task-hosted PS or a pipeline stage still use
(``pipeline.launch.task.rendezvous``): Spark's barrier calls cost about a second each (1.00 s measured
from the tasks' start to its return, 2 ranks on the 2-core box), paid by every allreduce attempt, and a
flat allreduce run's ranks connect to the driver's server anyway (metrics, failures, FINISH), where the
same exchange is a millisecond round trip. The wait has the step deadline (``timeouts.step_s``, named
with the ranks still missing) and ends at once when a peer fails, as a synchronous step's wait does.
Offers are JSON objects of at most a few fields, never unpickled; the connection is the authenticated one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pipeline.errors import ProtocolError
from pipeline.ps.server.messages import TIMEOUT, Refusal
from pipeline.ps.transport.protocol import Header, MsgType
from pipeline.wire.deadline import deadline_after

# An offer is a device kind and, from rank 0, a host and port: anything else is not from a shardline worker
# (and a world of large offers would not fit one reply, frames.MAX_JSON_BYTES).
DEVICE_KINDS = ("cpu", "cuda")
MAX_HOST_CHARS = 255


def offer_error(offer: Any) -> str | None:
    """Why ``offer`` is not a rendezvous offer, or None."""
    if not isinstance(offer, dict) or not set(offer) <= {"device", "allreduce"}:
        return f"an object with 'device' and, from rank 0, 'allreduce', got {str(offer)[:80]!r}"
    if offer.get("device") not in DEVICE_KINDS:
        return f"'device' one of {DEVICE_KINDS}, got {str(offer.get('device'))[:20]!r}"
    where = offer.get("allreduce")
    if where is not None and not (isinstance(where, list) and len(where) == 2 and isinstance(where[0], str)
                                  and 0 < len(where[0]) <= MAX_HOST_CHARS and type(where[1]) is int
                                  and 0 < where[1] < 65536):
        return f"'allreduce' a [host, port] pair, got {str(where)[:80]!r}"
    return None


@dataclass(frozen=True)
class RendezvousRequest:
    """RENDEZVOUS: what this rank offers its group."""

    offer: dict[str, Any]


@dataclass(frozen=True)
class Offers:
    """RENDEZVOUS reply: every rank's offer, in rank order."""

    offers: list[dict[str, Any]]

    def send_to(self, ctx: Any, conn: Any) -> None:
        conn.channel.send_json(MsgType.RENDEZVOUS, {"offers": self.offers}, generation=conn.generation,
                               rank=conn.rank, timeout=ctx.step_timeout.seconds)


class RendezvousHandler:
    """Shard 0's RENDEZVOUS: keep this rank's offer for its generation, answer once every rank's is in."""

    waits = True  # on peers: fail()/close() wake it, and it delivers its ERROR first
    ends_connection = False

    def read(self, ctx: Any, conn: Any, header: Header) -> RendezvousRequest:
        body = conn.channel.recv_json(header, deadline_after(ctx.step_timeout))
        if ctx.shard_index != 0:  # every shard keeps a roster, but the group meets on one: shard 0's
            raise ProtocolError(f"a RENDEZVOUS goes to shard 0, this is shard {ctx.shard_index}")
        offer = body.get("offer")
        error = offer_error(offer)
        if error is not None:
            raise ProtocolError(f"a RENDEZVOUS offer is {error}")
        return RendezvousRequest(offer)

    def handle(self, ctx: Any, conn: Any, request: RendezvousRequest) -> Offers:
        return Offers(meet(ctx.policy, conn, request.offer))


# What a failed peer stops here, in the policy's refusal: the meeting, not the mode's step or run.
STOPPED = "the allreduce rendezvous"


def meet(policy: Any, conn: Any, offer: dict[str, Any]) -> list[dict[str, Any]]:
    """Add ``conn``'s offer to its generation's (the roster's, forgotten with it) and wait for the rest."""
    core, roster = policy.core, policy.roster
    deadline = deadline_after(policy.timeout)
    with core.cond:
        refusal = policy.refusal_locked(conn, STOPPED)
        if refusal is None and conn.rank in roster.offers:
            refusal = f"rank {conn.rank} already sent its rendezvous offer in generation {conn.generation}"
        if refusal is not None:
            raise Refusal(refusal)
        roster.offers[conn.rank] = offer
        core.cond.notify_all()
        while True:
            # Complete first: once every offer is in, the group was formed, and a peer that fails right
            # after (it read the offers and refused the group, as a cuda rank among cpu ranks does) must not
            # turn a waiter that wakes a moment later into a consequence of it: each rank says why itself.
            if len(roster.offers) == policy.world_size:
                return [roster.offers[rank] for rank in range(policy.world_size)]
            refusal = policy.refusal_locked(conn, STOPPED)
            if refusal is not None:
                raise Refusal(refusal)
            gone = sorted(rank for rank in roster.finished if rank not in roster.offers)
            if gone:
                raise Refusal(f"rank(s) {', '.join(map(str, gone))} finished without a rendezvous offer, so "
                              "the allreduce group can never be complete")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(policy.world_size)) - set(roster.offers))
                never = roster.never_connected_locked(missing)
                what = f"the allreduce rendezvous: rank(s) {', '.join(map(str, missing))} sent no offer"
                if never:
                    what += f" (rank(s) {', '.join(map(str, never))} never connected)"
                raise Refusal(policy.timeout.message(what) + " if these workers are only slow", kind=TIMEOUT)
            core.cond.wait(left)


MEETING_HANDLERS = {MsgType.RENDEZVOUS: RendezvousHandler()}


class RendezvousRequests:
    """The client's end: a mixin of ``PSClient`` (its links, sends and gathers)."""

    def rendezvous(self, offer: dict[str, Any]) -> list[dict[str, Any]]:
        """Send ``offer`` (a small JSON object) to shard 0 and return every rank's, in rank order, once
        all ranks of this generation sent theirs."""
        links = self._require()[:1]
        what = "every rank's rendezvous offer"
        offers: list[list[dict[str, Any]]] = []

        def receive(link: Any, header: Header) -> int:
            body = link.channel.recv_json(header, deadline_after(self.step_timeout))
            got = body.get("offers")
            if not isinstance(got, list) or not all(isinstance(o, dict) for o in got):
                raise ProtocolError("a RENDEZVOUS reply carries a list of offers")
            offers.append(got)
            return header.step

        self._send_all(links, lambda link: link.channel.send_json(
            MsgType.RENDEZVOUS, {"offer": dict(offer)}, generation=self.generation, rank=self.rank,
            timeout=self.timeout_s), what)
        self._gather(links, MsgType.RENDEZVOUS, what, self._reply_wait, receive)
        return offers[0]
