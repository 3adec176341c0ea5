"""The one place that picks a task's training loop: a pipeline stage's (``plan.stage`` set) or the flat one."""
from __future__ import annotations

from typing import Callable, Optional

from pipeline.worker.distributed import Rendezvous
from pipeline.worker.loop import run_flat
from pipeline.worker.plan import WorkerPlan
from pipeline.worker.skeleton import WorkerResult
from pipeline.worker.stage_loop import StageWiring, run_stage


def run(plan: WorkerPlan, ps_host: str, ps_port: int, secret: bytes, *, device: str = "cpu",
        rendezvous: Optional[Rendezvous] = None, log_tail: Optional[Callable[[], str]] = None,
        wiring: Optional[StageWiring] = None, tls=None) -> WorkerResult:
    """Train this rank's share of the run; raise on any failure (the caller reports it).

    ``device`` is where the model trains (``cuda:N`` for the GPU Spark assigned the task); ``rendezvous``
    is the allreduce group's address (``train.backend: allreduce``); ``wiring`` a pipeline stage's links
    to its neighbours; ``log_tail`` gives this rank's recent log lines for the FAIL it sends; ``tls``
    (``ps.tls``) the job certificate's pinned fingerprint every connection checks."""
    if plan.stage is not None:  # parallelism.pipeline > 1: this task runs one stage of a replica
        return run_stage(plan, ps_host, ps_port, secret, wiring or StageWiring(), device=device,
                         rendezvous=rendezvous, log_tail=log_tail, tls=tls)
    return run_flat(plan, ps_host, ps_port, secret, device=device, rendezvous=rendezvous, log_tail=log_tail,
                    tls=tls)
