"""In the barrier task: the one allGather through which the tasks agree on everything they share.

Each rank offers what it hosts — rank 0 the task-hosted PS (ps.placement=task), a pipeline stage > 0 its
link listener, the first task of each allreduce group the authenticated store its group meets at
(``pipeline.worker.store``: already listening on the task's own address, so the port offered is the one
held, no probe socket) — and the kind of device it trains on, and learns what its peers offered. One ~1 s
rendezvous, not one per feature.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from pipeline.worker.plan import WorkerPlan


@dataclass(frozen=True)
class Found:
    """What the allGather told this rank."""

    ps: Optional[tuple[str, int]] = None  # the task-hosted PS
    allreduce: object = None  # a worker.distributed.Rendezvous for this rank's allreduce group
    next_link: Optional[tuple[str, int]] = None  # the next pipeline stage's link listener
    store: object = None  # the group's worker.store.StoreServer when this rank serves it (closed by the caller)


def own_host(context, rank: int) -> str:
    return context.getTaskInfos()[rank].address.rsplit(":", 1)[0]


def stage_listener(context, plan: WorkerPlan, secret: bytes, *, tls=None):
    """A pipeline stage > 0 listens for the previous stage's link on its executor's address:
    (listener, None) or (None, error text) — every rank must still reach the allGather."""
    from pipeline.parallel.link import StageListener

    try:
        listener = StageListener(own_host(context, plan.rank), secret, plan.generation, stage=plan.stage.stage,
                                 rank=plan.rank, expect_rank=plan.rank - 1, timeout_s=plan.deadlines.link,
                                 connect_timeout=plan.deadlines.connect, tls=tls)
        return listener, None
    except Exception as exc:  # noqa: BLE001 - reported through the allGather
        return None, f"rank {plan.rank} could not listen for its pipeline link: {type(exc).__name__}: {exc}"


def _serve_store(context, rank: int, secret: bytes, generation: int):
    """The group leader's StoreServer on its task address: (server, None) or (None, error text)."""
    from pipeline.worker.store import StoreServer

    try:
        return StoreServer(own_host(context, rank), secret, generation), None
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the allGather
        return None, f"rank {rank} could not serve the allreduce rendezvous store: {type(exc).__name__}: {exc}"


def _group_error(offers: list[dict], rank: int, stages: int) -> Optional[str]:
    """The mixed-device error of this rank's allreduce group (ranks r with r % stages == rank % stages)."""
    from pipeline.worker.device import mixed_devices_error

    kinds = {r: o.get("device", "cpu") for r, o in enumerate(offers) if r % stages == rank % stages}
    return mixed_devices_error(kinds)


def rendezvous(context, plan: WorkerPlan, *, ps=None, link=None, offer_error=None, secret: bytes = b"",
               device: str = "cpu"):
    """(Found, None), or (None, error text) when this rank or a peer could not offer what it hosts, or the
    ranks of an allreduce group do not all train on the same kind of device."""
    from pipeline.worker.device import device_kind
    from pipeline.worker.distributed import Rendezvous

    rank, grid = plan.rank, plan.stage
    stages = grid.stages if grid else 1
    leader = rank % stages  # the allreduce group's first rank (rank 0, or replica 0 of this stage)
    offer: dict = {"device": device_kind(device)}
    if ps is not None:
        offer["ps"] = list(ps)
    if link is not None:
        offer["link"] = list(link)
    server = None
    if plan.backend == "allreduce" and rank == leader and offer_error is None:
        server, offer_error = _serve_store(context, rank, secret, plan.generation)
        if server is not None:
            offer["allreduce"] = list(server.address)
    if offer_error is not None:
        offer["error"] = offer_error
    try:
        offers = [json.loads(m) for m in context.allGather(json.dumps(offer))]
    except Exception as exc:  # noqa: BLE001 - reported as this rank's failure row
        if server is not None:
            server.close()
        return None, f"rendezvous: the barrier allGather failed: {type(exc).__name__}: {exc}"
    errors = [(r, o["error"]) for r, o in enumerate(offers) if "error" in o]
    mixed = _group_error(offers, rank, stages) if plan.backend == "allreduce" else None
    if errors or mixed:
        if server is not None:
            server.close()
        mine = [e for r, e in errors if r == rank]
        return None, mine[0] if mine else (mixed or f"stopped: {errors[0][1]}")
    group = None
    if plan.backend == "allreduce":
        host, port = offers[leader]["allreduce"]
        group = Rendezvous(host, int(port), plan.deadlines.connect, secret=secret, generation=plan.generation,
                           local_host=own_host(context, rank))
    next_link = tuple(offers[rank + 1]["link"]) if grid and not grid.is_last else None
    ps_address = tuple(offers[0]["ps"]) if "ps" in offers[0] else None
    return Found(ps=ps_address, allreduce=group, next_link=next_link, store=server), None
