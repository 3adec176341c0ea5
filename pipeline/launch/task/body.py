"""In the barrier task: the mapInArrow body. Runs one worker and returns its outcome as rows, never raising
(see rows.py for why). The only place besides rendezvous.py that touches BarrierTaskContext."""
from __future__ import annotations

import collections
import logging
import os
import socket
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from pipeline.launch.task.rows import failure_row, task_origin, to_batches
from pipeline.worker.device import bind_device, choose_device
from pipeline.worker.plan import WorkerPlan

if TYPE_CHECKING:
    from pipeline.launch.task.host_shard import HostShardWiring
    from pipeline.launch.task.hosted_ps import HostedPSSpec
    from pipeline.wire.tls import PinnedCert, ServerCert

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskWiring:
    """Plain values every task needs besides its plan (shipped in the closure: no SparkSession, no self)."""

    secret: bytes
    log_tail_lines: int
    # The driver-hosted PS, or None with ps.placement=task (then `hosted` is set and the address comes
    # from rank 0 through the allGather).
    ps: Optional[tuple[str, int]] = None
    hosted: Optional["HostedPSSpec"] = None
    # ps.tls: the job's certificate and key (pipeline.wire.tls.ServerCert) for whichever process listens;
    # connectors pin its fingerprint. None: plain TCP.
    tls: Optional["ServerCert"] = None
    # ps.placement=hosts: the driver's registry the first task of each host starts its shard against; the
    # PS address is then shard 0's, offered by rank 0 in the allGather.
    hosts: Optional["HostShardWiring"] = None

    @property
    def pinned(self) -> Optional["PinnedCert"]:
        return self.tls.pinned() if self.tls is not None else None


class _TailHandler(logging.Handler):
    def __init__(self, lines: int):
        super().__init__(logging.DEBUG)
        self.lines: collections.deque[str] = collections.deque(maxlen=max(lines, 1))
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a log line must never fail training
            pass


def make_task_fn(plans: list[WorkerPlan], wiring: TaskWiring) -> Callable[[Iterator], Iterator]:
    """The mapInArrow body, built from plain values only."""

    def task(batches: Iterator) -> Iterator:
        from pyspark import BarrierTaskContext

        for _ in batches:  # the input frame only fixes the number of tasks
            pass
        context = BarrierTaskContext.get()
        plan = plans[context.partitionId()]
        gpu = assigned_gpu(context.resources())
        if wiring.hosted is None and wiring.hosts is None and plan.stage is None:  # the driver's PS: no rendezvous
            try:
                meeting = _meeting_at_ps(context, plan, wiring) if plan.backend == "allreduce" else None
            except Exception as exc:  # noqa: BLE001 - reported as this rank's failure row
                yield from to_batches(failure_row(plan.rank, f"rank {plan.rank} has no task address for the "
                                                             f"allreduce rendezvous: {type(exc).__name__}: {exc}", ""))
                return
            yield from to_batches(run_rank(plan, wiring.ps, wiring, gpu=gpu, rendezvous=meeting))
            return
        yield from to_batches(_run_with_rendezvous(context, plan, wiring, gpu))

    return task


def _meeting_at_ps(context, plan: WorkerPlan, wiring: TaskWiring):
    """A flat allreduce rank meets its group through the driver's PS (``pipeline.ps.server.meeting``: the barrier's
    allGather costs ~1 s per attempt), on this task's own address."""
    from pipeline.launch.task.rendezvous import own_host
    from pipeline.worker.distributed import MeetingAtPS

    return MeetingAtPS(own_host(context, plan.rank), wiring.secret, plan.generation, plan.deadlines.connect)


def _run_with_rendezvous(context, plan: WorkerPlan, wiring: TaskWiring, gpu: Optional[str]) -> dict:
    from pipeline.launch.task.rendezvous import own_host, rendezvous, stage_listener

    host_ps = listener = found = shard = None
    offer_error, device = None, "cpu"
    try:
        if wiring.hosts is not None:  # ps.placement=hosts: first, so the shard's torch import overlaps this task's
            from pipeline.launch.task.host_shard import spawn_host_shard

            shard, offer_error = spawn_host_shard(context, plan, wiring)
        # Import what training needs before the rendezvous: a fresh Python worker's torch import must not eat
        # into the deadlines that start there (a peer's PS wait, the connect watchdog).
        from pipeline.worker import loop as _preloaded  # noqa: F401

        try:  # before the rendezvous: the group's ranks must agree on cuda vs cpu before joining
            device = choose_device(gpu)
        except Exception as exc:  # noqa: BLE001 - every rank must still reach the allGather
            offer_error = offer_error or f"rank {plan.rank}: {type(exc).__name__}: {exc}"
        if plan.rank == 0 and wiring.hosted is not None and offer_error is None:
            host_ps, offer_error = _start_hosted_ps(wiring, own_host(context, 0))
        if shard is not None and offer_error is None:  # ps.placement=hosts: set up by the driver
            from pipeline.launch.task.host_shard import await_host_shard

            offer_error = await_host_shard(shard, plan, wiring)
        if plan.stage is not None and plan.stage.stage > 0 and offer_error is None:
            listener, offer_error = stage_listener(context, plan, wiring.secret, tls=wiring.tls)
        offered = host_ps.server.address if host_ps is not None else None
        if shard is not None and plan.rank == 0:  # host 0's shard, the one whose WELCOME names the others
            offered = shard.address
        found, error = rendezvous(context, plan, ps=offered,
                                  link=listener.address if listener is not None else None, offer_error=offer_error,
                                  secret=wiring.secret, device=device)
        if error is not None:
            return failure_row(plan.rank, error, "")
        if host_ps is not None:
            host_ps.watch()
        address = found.ps or wiring.ps  # a pipeline stage's own server is in plan.stage.ps
        stage_wiring = None
        if plan.stage is not None:
            from pipeline.worker.stage_loop import StageWiring

            stage_wiring = StageWiring(listener, found.next_link)  # closed by the stage loop, and below
        row = run_rank(plan, address, wiring, gpu=gpu, rendezvous=found.allreduce, stage_wiring=stage_wiring,
                       device=device)
        if host_ps is not None:
            row = host_ps.finish(row)
        if shard is not None:  # the other ranks still use this host's shard: hold it until the driver ends it
            shard.wait_exit()
        return row
    finally:
        if shard is not None:
            shard.close()
        if found is not None and found.store is not None:
            found.store.close()
        if listener is not None:
            listener.close()
        if host_ps is not None:
            host_ps.__exit__(None, None, None)


def _start_hosted_ps(wiring: TaskWiring, host: str):
    """Rank 0: start the PS on this executor's address; (HostedPS, None) or (None, error text)."""
    from pipeline.launch.task.hosted_ps import HostedPS

    try:
        return HostedPS(wiring.hosted, host, wiring.secret, tls=wiring.tls).__enter__(), None
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the allGather
        log.exception("rank 0 could not start the parameter server")
        return None, f"rank 0 could not start the parameter server (ps.placement=task): {type(exc).__name__}: {exc}"


def assigned_gpu(resources) -> Optional[str]:
    """The GPU address Spark gave this task (spark.task.resource.gpu.amount), or None."""
    gpu = resources.get("gpu") if resources else None
    addresses = list(getattr(gpu, "addresses", []) or [])
    return str(addresses[0]) if addresses else None


def run_rank(plan: WorkerPlan, address: Optional[tuple[str, int]], wiring: TaskWiring, *, gpu: Optional[str] = None,
             rendezvous=None, stage_wiring=None, device: Optional[str] = None) -> dict:
    """Run the worker for one rank; on failure return the error and this rank's log tail as the row."""
    from pipeline.errors import is_retryable
    from pipeline.worker import run

    # host:parent-pid/pid — Python workers fork from one daemon per executor, so the parent pid tells
    # executors apart on one host. The host as Spark addresses the executor (hostnames can repeat: network
    # namespaces, containers), else this machine's name.
    origin = task_origin()
    process = f"{origin['address'] or socket.gethostname()}:{os.getppid()}/{os.getpid()}"
    logger = logging.getLogger("pipeline")
    handler = _TailHandler(wiring.log_tail_lines)
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        try:
            device = choose_device(gpu) if device is None else device
            # Before the loader pins host memory or the model moves: their CUDA context goes on this device.
            bind_device(device)
        except BaseException as exc:
            _tell_ps(plan, address, wiring, exc)
            raise
        result = run(plan, address[0], int(address[1]), wiring.secret, device=device, rendezvous=rendezvous,
                     log_tail=lambda: "\n".join(handler.lines), wiring=stage_wiring, tls=wiring.pinned)
        return {"rank": plan.rank, "ok": True, "error": None, "log_tail": None, "retryable": None,
                "steps": result.steps, "samples": result.samples, "seconds": result.seconds,
                "final_train_loss": result.final_train_loss, "process": process, "device": result.device,
                "gpu": gpu, "parameters_digest": result.parameters_digest, "parameters": result.parameters,
                "ps_report": None, "buffers": result.buffers, **origin}
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the driver as a row
        error = f"{type(exc).__name__}: {exc}"
        if plan.stage is not None:  # name the stage too: a pipeline failure is located by (rank, stage)
            error = f"{plan.stage.describe()}: {error}"
        logger.error("rank %d failed: %s\n%s", plan.rank, error, traceback.format_exc())
        return {**failure_row(plan.rank, error, "\n".join(handler.lines), process, retryable=is_retryable(exc)),
                "gpu": gpu}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def _tell_ps(plan: WorkerPlan, address: Optional[tuple[str, int]], wiring: TaskWiring, exc: BaseException) -> None:
    """A FAIL for a failure before this rank connected (its device): peers waiting for it on the server (a
    synchronous step, the allreduce rendezvous) stop now instead of at their deadline. Best effort."""
    from pipeline.ps import PSClient

    if address is None:
        return
    try:
        with PSClient(address[0], int(address[1]), rank=plan.rank, secret=wiring.secret,
                      generation=plan.generation, timeout_s=plan.deadlines.step,
                      connect_timeout=plan.deadlines.connect, tls=wiring.pinned) as client:
            client.report_failure(exc)  # connects for its FAIL, never raises
    except Exception:  # the failure row still reports it; this only spares the peers their deadline
        log.debug("rank %d could not tell the parameter server it failed", plan.rank, exc_info=True)


__all__ = ["TaskWiring", "make_task_fn", "run_rank"]
