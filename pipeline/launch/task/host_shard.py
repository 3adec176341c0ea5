"""In the barrier task (``ps.placement: hosts``): the first task on each host starts that host's
parameter-server shard process and holds it for the attempt.

Which task is first, which host is which and how many there are come from ``getTaskInfos`` (every task
sees the same list, in rank order), so no extra rendezvous is needed: host k is the k-th distinct executor
address in rank order, and its first rank starts shard k. Rank 0 therefore always starts shard 0, whose
address it offers in the barrier's one allGather; every worker connects there and the WELCOME names the
other shards. The task waits for ``READY`` (the driver has attached every host's shard and loaded the
state) before that allGather, so no worker ever reaches a shard that is not set up.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.wire.deadline import Timeout

if TYPE_CHECKING:
    from pipeline.worker.plan import WorkerPlan

log = logging.getLogger(__name__)

# Past the connect deadline (every host's process reaching the driver), what the driver may take to set
# the shards up: start them, announce the layout, send each its slice of the state.
SETUP_S = 60.0


@dataclass(frozen=True)
class HostShardWiring:
    """Plain values the tasks need to start their host's shard (shipped in the closure)."""

    registry: tuple[str, int]  # the driver's ShardRegistry of this attempt
    connect: Timeout  # the shard process's deadline to reach the driver
    max_bytes: int  # the largest control message (a slice's state)


def task_hosts(context) -> list[str]:
    """Every rank's executor address, in rank order (what ``rendezvous.own_host`` gives each rank)."""
    return [info.address.rsplit(":", 1)[0] for info in context.getTaskInfos()]


def spawn_host_shard(context, plan: "WorkerPlan", wiring):
    """``wiring``: the task's ``body.TaskWiring`` (its ``hosts`` set). Start this host's shard process when
    this is the host's first rank: (HostShardProcess, None); (None, None) for every other rank; (None, error
    text) when it could not be started: every rank must still reach the allGather."""
    from pipeline.ps.processes.host_shard import Bootstrap, HostShardProcess

    spread = wiring.hosts
    addresses = task_hosts(context)
    mine = addresses[plan.rank]
    if addresses.index(mine) != plan.rank:
        return None, None
    order = list(dict.fromkeys(addresses))
    boot = Bootstrap(registry=spread.registry, secret_hex=wiring.secret.hex(), generation=plan.generation,
                     index=order.index(mine), hosts=len(order), host=mine, connect_s=spread.connect.seconds,
                     connect_key=spread.connect.key, max_bytes=spread.max_bytes,
                     tls_fingerprint=wiring.tls.fingerprint if wiring.tls is not None else None)
    try:
        return HostShardProcess(boot, python_path=_package_root()), None
    except Exception as exc:  # noqa: BLE001 - reported through the allGather
        return None, _cannot(plan, boot, exc)


def await_host_shard(process, plan: "WorkerPlan", wiring):
    """Wait until the driver has set this host's shard up (None), or the error text for the allGather (the
    process is then closed)."""
    boot = process.boot
    try:
        address = process.wait_ready(Timeout(wiring.hosts.connect.seconds + SETUP_S, wiring.hosts.connect.key))
    except Exception as exc:  # noqa: BLE001 - reported through the allGather
        process.close()
        return _cannot(plan, boot, exc)
    log.info("rank %d started the parameter-server shard of host %d of %d (%s:%d, pid %d)", plan.rank, boot.index,
             boot.hosts, address[0], address[1], process.pid)
    return None


def _cannot(plan: "WorkerPlan", boot, exc: BaseException) -> str:
    return (f"rank {plan.rank} could not start the parameter-server shard of host {boot.index} ({boot.host}, "
            f"ps.placement=hosts): {type(exc).__name__}: {exc}")


def _package_root() -> str:
    """Where this task imported ``pipeline`` from (a shipped wheel or zip on an executor): the shard
    process must import the same code."""
    import pipeline

    return os.path.dirname(os.path.dirname(os.path.abspath(pipeline.__file__)))
