"""The per-task loop of one pipeline stage (``parallelism.pipeline > 1``): GPipe steps, then the stage's PS
exchange.

Barrier rank ``g`` is stage ``g % P`` of replica ``g // P``. Each stage is an ordinary PS worker of its
stage's server (rank = replica index, world = D), so the server averages the D replicas' gradients of
that stage and steps its slice; with ``train.backend: allreduce`` the stage group averages gradients
with one allreduce per step instead. Only the first stage reads features and only the last reads
labels, from the replica's shard with the same seeded shuffle, so their batches line up row for row.

No Spark here: links and addresses come in as plain values, so stages can run in threads in tests.
What this loop shares with the flat one is in ``pipeline.worker.skeleton``.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

from pipeline.data.batch import to_device
from pipeline.errors import PSError
from pipeline.worker.guards import batch_inputs, check_finite, keeps_its_type, model_input_error
from pipeline.worker.plan import StagePlan, WorkerPlan
from pipeline.worker.skeleton import (FaultHooks, LogStream, WorkerResult, failures_reported, final_parameters,
                                      make_train_loader, ps_session, seed_rank)

log = logging.getLogger(__name__)

# Marks a stage's error as fallout of a neighbour's failure (pipeline.ps.server.staged ranks root causes by it).
LINK_CONSEQUENCE = "pipeline link"


class StageLinkError(RuntimeError):
    """A stage's link to a neighbour broke (usually because that neighbour failed first). Not a PSError
    on purpose: the worker then reports it to its stage's PS (FAIL), so the driver can tell it from the
    neighbour's own failure."""


@dataclass(frozen=True)
class StageWiring:
    """How this stage reaches its neighbours: its listener for the previous stage (None on stage 0) and
    the next stage's listener address (None on the last stage)."""

    listener: object = None
    next_address: Optional[tuple[str, int]] = None


def model_stages(model, stages: int, cuts=None) -> list:
    """The stage modules of the whole model (``pipeline.parallel.stages.model_stages``)."""
    from pipeline.parallel.stages import model_stages as split

    return split(model, stages, cuts)


def run_stage(plan: WorkerPlan, ps_host: str, ps_port: int, secret: bytes, wiring: StageWiring, *,
              device: str = "cpu", rendezvous=None, log_tail=None, tls=None) -> WorkerResult:
    """Train this task's stage (``plan.stage``); raise on any failure (the caller reports it, naming rank
    and stage). The stage's own server (``plan.stage.ps``), when the plan names one, replaces the
    address given."""
    grid = plan.stage
    if grid is None:
        raise ValueError(f"rank {plan.rank}: run_stage needs a plan with a stage (parallelism.pipeline > 1)")
    if grid.ps is not None:
        ps_host, ps_port = grid.ps
    try:
        return _run_stage(plan, grid, ps_host, int(ps_port), secret, wiring, device=device, rendezvous=rendezvous,
                          log_tail=log_tail, tls=tls)
    finally:
        if wiring.listener is not None:  # also when failing before the links were set up
            wiring.listener.close()


def _run_stage(plan: WorkerPlan, grid: StagePlan, ps_host: str, ps_port: int, secret: bytes, wiring: StageWiring,
               *, device: str, rendezvous, log_tail, tls) -> WorkerResult:
    import torch

    from pipeline.models import build_model, loss_fn
    from pipeline.parallel.schedule import GPipeStage

    seed_rank(plan)
    started = time.perf_counter()
    faults = FaultHooks(plan.faults, plan.rank)
    with ps_session(plan, ps_host, ps_port, secret, rank=grid.replica, log_tail=log_tail, tls=tls) as (client, info):
        loader = None
        if grid.is_first or grid.is_last:
            # Seeded by the replica, so the first and last stage of a replica draw the same rows.
            # The arrow reader skips the column a stage does not need; petastorm reads both.
            both = plan.loader.reader != "arrow"
            loader = make_train_loader(plan, rank=grid.replica, fields=(
                plan.features_field if grid.is_first or both else None,
                plan.label_field if grid.is_last or both else None))
        module = model_stages(build_model(plan.model), grid.stages, grid.cuts)[grid.stage].to(device)
        group = _stage_group(rendezvous, grid, faults, device) if plan.backend == "allreduce" else nullcontext()
        with group, _links(plan, grid, secret, wiring, tls) as (prev, nxt):
            gpipe = GPipeStage(module, stage=grid.stage, stages=grid.stages, micro_batches=grid.micro_batches,
                               prev=prev, next=nxt, loss_fn=loss_fn(plan.model) if grid.is_last else None,
                               device=torch.device(device))
            # Reported before the links and the group close under the neighbours.
            with failures_reported(client), LogStream(client, plan.rank) as logs:
                return _train(plan, grid, client, info, module, gpipe, loader, device, faults, logs, started)


class _links:
    """Accept the previous stage's link, then connect to the next (in that order on every stage, so the
    chain forms without a deadlock); both closed on the way out."""

    def __init__(self, plan: WorkerPlan, grid: StagePlan, secret: bytes, wiring: StageWiring, tls=None):
        self.plan, self.grid, self.secret, self.wiring, self.tls = plan, grid, secret, wiring, tls
        self.prev = self.next = None

    def __enter__(self):
        from pipeline.parallel.link import connect_link

        plan, grid, deadlines = self.plan, self.grid, self.plan.deadlines
        try:
            if not grid.is_first:
                self.prev = self.wiring.listener.accept(deadlines.connect)
            if not grid.is_last:
                host, port = self.wiring.next_address
                self.next = connect_link(host, int(port), self.secret, plan.generation, stage=grid.stage,
                                         rank=plan.rank, expect_rank=plan.rank + 1, timeout_s=deadlines.link,
                                         connect_timeout=deadlines.connect, tls=self.tls)
        except PSError as exc:
            self.__exit__(None, None, None)
            raise StageLinkError(f"{LINK_CONSEQUENCE} of stage {grid.stage} could not be set up: {exc}") from exc
        return self.prev, self.next

    def __exit__(self, *exc) -> None:
        for link in (self.prev, self.next):
            if link is not None:
                link.close()
        if self.wiring.listener is not None:
            self.wiring.listener.close()


def _stage_group(rendezvous, grid: StagePlan, faults: FaultHooks, device: str):
    from pipeline.worker.distributed import process_group

    if rendezvous is None:
        raise ValueError("train.backend=allreduce needs a rendezvous address for the stage group")
    faults.joining_group()
    return process_group(rendezvous, grid.replica, grid.replicas, device)


def _allreduce_gradients(module, replicas: int) -> None:
    """The stage group's mean gradient, in place (one flat allreduce per step)."""
    import torch.distributed as dist

    from pipeline.models.flat import flat_gradients

    flat = flat_gradients(module)
    dist.all_reduce(flat)
    flat /= replicas
    offset = 0
    for p in module.parameters():
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def _gpipe_step(plan: WorkerPlan, grid: StagePlan, gpipe, step: int, epoch: int, x, y):
    """One GPipe step; a broken link becomes a StageLinkError (fallout of a neighbour) and an error of
    this stage's module or loss on its inputs a ModelInputError (a retry would raise it again)."""
    try:
        return gpipe.step(step, features=x if grid.is_first else None, labels=y if grid.is_last else None)
    except PSError as exc:
        raise StageLinkError(f"{LINK_CONSEQUENCE} of stage {grid.stage} broke in step {step}: {exc}") from exc
    except Exception as exc:
        if keeps_its_type(exc):
            raise
        received = None if grid.is_first else f"from stage {grid.stage - 1}"
        raise model_input_error(exc, plan.model, rank=plan.rank, step=step, epoch=epoch, where=f" ({grid.describe()})",
                                inputs=batch_inputs(x if grid.is_first else None, y if grid.is_last else None,
                                                    received=received)) from exc


def _train(plan: WorkerPlan, grid: StagePlan, client, info, module, gpipe, loader, device: str,
           faults: FaultHooks, logs: LogStream, started: float) -> WorkerResult:
    from pipeline.worker.exchange import make_exchange

    level = logging.INFO if plan.rank == 0 else logging.DEBUG
    exchange = make_exchange(client, info, module, plan.total_steps, plan.optimizer,
                             plan.backend)
    step = exchange.begin()  # start() + the server's buffers
    first_epoch, skip = plan.locate(step)
    log.log(level, "rank %d = stage %d/%d of replica %d/%d: %d parameters, %d micro-batches, starting at step %d",
            plan.rank, grid.stage, grid.stages, grid.replica, grid.replicas, info.num_params,
            grid.micro_batches, step)
    samples, last_loss = 0, float("nan")
    for epoch in range(first_epoch, plan.epochs):
        start = skip if epoch == first_epoch else 0
        batches = loader.epoch(epoch, start_step=start) if loader is not None else None
        epoch_started = time.perf_counter()
        loss_sum, rows = 0.0, 0
        gpipe.take()
        for _ in range(start, plan.steps_per_epoch):
            x = y = None
            if batches is not None:
                x, y = next(batches)
                if device != "cpu":
                    x, y = to_device(x, device), y.to(device, non_blocking=True)
            faults.before_step(step)
            for p in module.parameters():
                p.grad = None
            stats = _gpipe_step(plan, grid, gpipe, step, epoch, x, y)
            if grid.is_last:  # the loss GPipe already took off the device: no extra sync
                check_finite(stats.loss, rank=plan.rank, step=step, epoch=epoch, where=f" ({grid.describe()})")
            if plan.backend == "allreduce":
                try:
                    _allreduce_gradients(module, grid.replicas)
                except RuntimeError as exc:  # a peer replica of this stage went away first
                    raise StageLinkError(f"stage group allreduce of stage {grid.stage} failed in step {step}: "
                                         f"{exc}") from exc
            step = exchange.after_backward(step)
            if grid.is_last:
                loss_sum += stats.loss * stats.rows
                rows += stats.rows
            logs.tick()
        seconds = time.perf_counter() - epoch_started
        epoch_stats = gpipe.take()
        samples += rows
        metrics = {"epoch": epoch, "step": step, "samples": rows, "seconds": seconds,
                   "step_time_s": seconds / max(plan.steps_per_epoch - start, 1), "stage": grid.stage,
                   "compute_s": epoch_stats.compute_s, "idle_s": epoch_stats.idle_s,
                   "bytes_sent": float(epoch_stats.bytes_sent), "bubble_fraction": epoch_stats.bubble_fraction,
                   **exchange.stats.take()}
        if grid.is_last:
            last_loss = loss_sum / max(rows, 1)
            metrics["train_loss"] = last_loss
        log.log(level, "rank %d (stage %d) epoch %d: compute %.2fs, idle %.2fs (bubble %.0f%%)%s", plan.rank,
                grid.stage, epoch, epoch_stats.compute_s, epoch_stats.idle_s,
                100 * epoch_stats.bubble_fraction, f", loss {last_loss:.4f}" if grid.is_last else "")
        exchange.end_epoch(step)  # buffers to the server, before the report a checkpoint waits for
        logs.report(metrics)
    digest = parameters = buffers = None
    if plan.backend == "allreduce":
        # Replica 0 of each stage returns the stage's slice.
        digest, parameters, buffers = final_parameters(module, keep=grid.replica == 0)
    return WorkerResult(rank=plan.rank, steps=step, samples=samples, seconds=time.perf_counter() - started,
                        final_train_loss=last_loss, device=device, parameters_digest=digest, parameters=parameters,
                        buffers=buffers)
