"""The allreduce backend's process group: joined at a rendezvous address, always destroyed on the way out.

No Spark here: the group's first task serves its authenticated store (worker/store.py) and its address
reaches the others through the driver's parameter server (``MeetingAtPS``, a flat run with the PS on the
driver) or the barrier's allGather (launch/task/rendezvous.py: a task-hosted PS, pipeline stages), as plain
values.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Union

from pipeline.wire.deadline import CONNECT_KEY, Timeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """Where a process group meets, and how long joining may take (``timeouts.connect_s``; a bare number
    is taken as that key following ``ps.timeout_s``).

    ``host:port`` is the group's authenticated store (``pipeline.worker.store.StoreServer``, served by the
    group's first rank); ``secret`` and ``generation`` are what a rank proves to it. ``local_host`` is this
    rank's own task address: gloo's and NCCL's sockets are bound to its interface, never a wildcard."""

    host: str
    port: int
    timeout: Union[Timeout, float]
    secret: bytes = b""
    generation: int = 0
    local_host: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout", Timeout.of(self.timeout, CONNECT_KEY))


@dataclass(frozen=True)
class MeetingAtPS:
    """A flat allreduce rank's way to its group through the driver's parameter server instead of the
    barrier's allGather (``pipeline.ps.server.meeting`` says why): rank 0 serves the group's authenticated store
    on ``local_host`` (its task's own address), every rank offers its device kind over its PS connection
    and learns the store's address from rank 0's offer. ``timeout`` is joining the group's
    (``timeouts.connect_s``), as for a :class:`Rendezvous`."""

    local_host: str
    secret: bytes
    generation: int
    timeout: Union[Timeout, float]

    @contextmanager
    def joined(self, client, rank: int, device: str) -> Iterator[Rendezvous]:
        """The :class:`Rendezvous` this rank's group meets at; rank 0's store is served for the block.

        A failure here or in the block (joining the group included) goes to the server as this rank's FAIL
        before rank 0's store closes: the peers then fail on the closed store, and the server must hear
        the cause first (``PSClient.report_failure`` sends one FAIL per failure)."""
        from pipeline.worker.device import device_kind, mixed_devices_error
        from pipeline.worker.store import StoreServer

        offer: dict = {"device": device_kind(device)}
        store = None
        try:
            if rank == 0:
                store = StoreServer(self.local_host, self.secret, self.generation)
                offer["allreduce"] = list(store.address)
            offers = client.rendezvous(offer)
            mixed = mixed_devices_error({r: o.get("device", "cpu") for r, o in enumerate(offers)})
            if mixed:
                raise RuntimeError(mixed)
            if not offers[0].get("allreduce"):
                raise RuntimeError("rank 0's rendezvous offer names no store address; driver and workers must "
                                   "run the same shardline version")
            host, port = offers[0]["allreduce"]
            yield Rendezvous(str(host), int(port), self.timeout, secret=self.secret, generation=self.generation,
                             local_host=self.local_host)
        except BaseException as exc:
            client.report_failure(exc)
            raise
        finally:
            if store is not None:
                store.close()


def _fresh_group_names() -> None:
    """Spark reuses Python workers, and torch names each new default process group by a per-process
    counter that destroy_process_group() does not reset: a reused worker would then wait for other
    rendezvous keys than a fresh peer (DistStoreError: wait timeout, keys /default_pg/2/... vs /1/...).
    Every rank starts its group from the same counter instead."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def _torch_device(device: str):
    import torch

    return torch.device(device)


@contextmanager
def process_group(rendezvous: Rendezvous, rank: int, world_size: int, device: str) -> Iterator[str]:
    """torch.distributed for this rank (gloo on CPU, nccl on CUDA) over the group's authenticated store;
    yields the backend name."""
    from datetime import timedelta

    import torch.distributed as dist

    from pipeline.worker.collective_env import bound_interfaces, release
    from pipeline.worker.device import bind_device
    from pipeline.worker.store import make_auth_store

    if not rendezvous.secret:
        raise ValueError("the allreduce rendezvous needs the job secret: an unauthenticated store would let "
                         "anyone who reaches it join the group")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    address = f"{rendezvous.host}:{rendezvous.port}"
    _fresh_group_names()
    timeout = rendezvous.timeout
    # NCCL creates its communicator (and a CUDA context) on the current device: it must be this rank's.
    bind_device(device)
    store = None
    try:
        store = make_auth_store(rendezvous.host, rendezvous.port, rendezvous.secret, rank=rank,
                                generation=rendezvous.generation, timeout_s=timeout.seconds)
        # NCCL: connect now (device_id), while the interface variable is set, not at the first collective.
        eager = {"device_id": _torch_device(device)} if backend == "nccl" else {}
        with bound_interfaces(rendezvous.local_host, backend):
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout.seconds), **eager)
    except Exception as exc:
        if store is not None:
            store.close()
        raise RuntimeError(f"rank {rank}: the allreduce rendezvous at {address} ({backend}, {world_size} ranks) "
                           f"failed within {timeout.seconds:g}s: {type(exc).__name__}: {exc}; check that "
                           f"executors can reach each other, or {timeout.hint}") from exc
    log.debug("rank %d joined the %s process group at %s", rank, backend, address)
    failed = True
    try:
        yield backend
        failed = False
    finally:
        # Also on failure: closing this rank's sockets makes peers blocked in a collective fail now
        # instead of waiting for the collective timeout (NCCL: the communicator is aborted first).
        release(backend, failed)
        store.close()
