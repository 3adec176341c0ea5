"""In the barrier task: the one allGather through which the tasks agree on everything they share.

Each rank offers what it hosts — rank 0 the task-hosted PS (ps.placement=task), a pipeline stage > 0 its
link listener, the first task of each allreduce group a free port on its host for the group's
rendezvous — and learns what its peers offered. One ~1 s rendezvous, not one per feature.
"""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Optional

from pipeline.worker.plan import WorkerPlan


@dataclass(frozen=True)
class Found:
    """What the allGather told this rank."""

    ps: Optional[tuple[str, int]] = None  # the task-hosted PS
    allreduce: object = None  # a worker.distributed.Rendezvous for this rank's allreduce group
    next_link: Optional[tuple[str, int]] = None  # the next pipeline stage's link listener


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


def rendezvous(context, plan: WorkerPlan, *, ps=None, link=None, offer_error=None):
    """(Found, None), or (None, error text) when this rank or a peer could not offer what it hosts."""
    from pipeline.worker.distributed import Rendezvous

    rank, grid = plan.rank, plan.stage
    stages = grid.stages if grid else 1
    leader = rank % stages  # the allreduce group's first rank (rank 0, or replica 0 of this stage)
    offer: dict = {}
    if offer_error is not None:
        offer["error"] = offer_error
    if ps is not None:
        offer["ps"] = list(ps)
    if link is not None:
        offer["link"] = list(link)
    probe = None
    if plan.backend == "allreduce" and rank == leader:
        host = own_host(context, rank)
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.bind((host, 0))
        offer["allreduce"] = [host, probe.getsockname()[1]]
    try:
        offers = [json.loads(m) for m in context.allGather(json.dumps(offer))]
    except Exception as exc:  # noqa: BLE001 - reported as this rank's failure row
        return None, f"rendezvous: the barrier allGather failed: {type(exc).__name__}: {exc}"
    finally:
        # Held through the allGather: two group leaders on one host then cannot be offered the same port.
        if probe is not None:
            probe.close()
    errors = [(r, o["error"]) for r, o in enumerate(offers) if "error" in o]
    if errors:
        mine = [e for r, e in errors if r == rank]
        return None, mine[0] if mine else f"stopped: {errors[0][1]}"
    group = None
    if plan.backend == "allreduce":
        host, port = offers[leader]["allreduce"]
        group = Rendezvous(host, int(port), plan.deadlines.connect)
    next_link = tuple(offers[rank + 1]["link"]) if grid and not grid.is_last else None
    ps_address = tuple(offers[0]["ps"]) if "ps" in offers[0] else None
    return Found(ps=ps_address, allreduce=group, next_link=next_link), None
