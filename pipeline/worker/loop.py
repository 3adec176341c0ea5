"""The flat per-task training loop: pull parameters, forward/backward on the local shard, push gradients
(or, with ``train.backend: allreduce``, average them across ranks with DDP).

No Spark here: the loop only needs its plan, the PS address and the run's secret, so it can be tested
in plain threads or processes. What it shares with the stage loop (PS session, loader, logs, faults,
result) is in ``pipeline.worker.skeleton``; ``pipeline.worker.entry.run`` picks the loop.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext

from pipeline.data.batch import to_device
from pipeline.worker.guards import batch_inputs, check_finite, keeps_its_type, model_input_error
from pipeline.worker.plan import WorkerPlan
from pipeline.worker.skeleton import (FaultHooks, InjectedFault, LogStream, WorkerResult, failures_reported,
                                      final_parameters, make_train_loader, ps_session, seed_rank)

# Importable from here as before (tests, fault-injection users).
__all__ = ["InjectedFault", "WorkerResult", "make_train_loader", "run_flat"]

log = logging.getLogger(__name__)


def run_flat(plan: WorkerPlan, ps_host: str, ps_port: int, secret: bytes, *, device: str = "cpu",
             rendezvous=None, log_tail=None, tls=None) -> WorkerResult:
    """Train this rank's share of the run (one whole model replica); raise on any failure.

    backend ps: gradients go to the server in its ``ps.mode``. backend allreduce: the model is wrapped in
    DistributedDataParallel over a process group joined at ``rendezvous`` (a worker.distributed.Rendezvous,
    or a MeetingAtPS that finds it over this rank's PS connection); the PS connection still carries metrics,
    failures and FINISH."""
    from pipeline.models import build_model, loss_fn

    seed_rank(plan)
    started = time.perf_counter()
    faults = FaultHooks(plan.faults, plan.rank, plan.generation)
    with ps_session(plan, ps_host, ps_port, secret, log_tail=log_tail, tls=tls) as (client, info):
        loader = make_train_loader(plan)
        # This rank's part of the validation split (pipeline.worker.validation); none where it has no rows.
        validation = _validation_part(plan, device) if plan.validation_files else None
        model = build_model(plan.model).to(device)
        # Before the rendezvous: a local optimizer's first construction imports torch._dynamo (seconds on a
        # fresh Python worker), which must not run while the peers wait in DDP's first broadcast.
        exchange = _exchange(plan, client, info, model, device)
        group = (_process_group(rendezvous, plan, faults, device, client) if plan.backend == "allreduce"
                 else nullcontext())
        with group, failures_reported(client), LogStream(client, plan.rank) as logs:
            return _train(plan, info, exchange, model, loss_fn(plan.model), loader, validation, device, faults,
                          logs, started)


def _validation_part(plan: WorkerPlan, device: str):
    from pipeline.worker.validation import ValidationPart

    return ValidationPart(plan.validation_files, plan.validation_rows, features_field=plan.features_field,
                          label_field=plan.label_field, num_features=plan.num_features,
                          features=plan.model.feature_set, device=device,
                          cache_bytes=int(plan.validation_cache_mb * 2**20))


def _exchange(plan: WorkerPlan, client, info, model, device: str):
    from pipeline.worker.exchange import make_exchange
    from pipeline.worker.precision import Precision

    precision = Precision(plan.precision, device)  # fp16 on a CPU worker fails here, naming the key
    return make_exchange(client, info, model, plan.total_steps, plan.optimizer, plan.backend,
                         precision, flat=True, overlap=plan.overlap)


def _sparse_hook(plan: WorkerPlan, exchange, info, model):
    from pipeline.worker.sparse_hook import sparse_hook

    return sparse_hook(exchange.client, model, mode=info.mode, overlap=plan.overlap, backend=plan.backend,
                       wire_dtype=plan.model.sparse.get("wire_dtype", "fp32"))


def _process_group(rendezvous, plan: WorkerPlan, faults: FaultHooks, device: str, client):
    from pipeline.worker.distributed import MeetingAtPS, process_group

    if rendezvous is None:
        raise ValueError("train.backend=allreduce needs a rendezvous address (given by the barrier task)")
    faults.joining_group()
    if isinstance(rendezvous, MeetingAtPS):
        return _met_group(rendezvous, plan, device, client)
    return process_group(rendezvous, plan.rank, plan.world_size, device)


@contextmanager
def _met_group(meeting, plan: WorkerPlan, device: str, client):
    """The process group at the address the ranks agreed on through the PS (rank 0's store served for
    the whole run: the group's teardown still talks to it)."""
    from pipeline.worker.distributed import process_group

    with meeting.joined(client, plan.rank, device) as rendezvous, \
            process_group(rendezvous, plan.rank, plan.world_size, device) as backend:
        yield backend


def _train(plan: WorkerPlan, info, exchange, model, loss, loader, validation, device: str, faults: FaultHooks,
           logs: LogStream, started: float) -> WorkerResult:
    from pipeline.models.losses import loss_weight
    from pipeline.worker.timing import step_timer
    from pipeline.worker.validation import evaluate_part

    precision = exchange.precision
    weight_of = loss_weight(plan.model)  # the validation parts' loss denominators
    level = logging.INFO if plan.rank == 0 else logging.DEBUG
    samples = 0
    last_loss = float("nan")
    step = exchange.begin()  # start() + the server's buffers
    sparse = _sparse_hook(plan, exchange, info, model)  # ps.sparse: None for a model without sparse tables
    timer = exchange.timed(step_timer(plan.profile, device))  # train.profile; a no-op timer when off
    forward = model
    if plan.backend == "allreduce":
        from pipeline.worker.ddp import wrap

        forward = wrap(model, device, shared_memory=plan.allreduce_shared_memory, timeout=plan.deadlines.step)
    # A retried attempt (new generation) starts at the server's step for this rank; the epoch and the
    # batch within it follow from it, so no sample is skipped or trained on twice.
    first_epoch, skip = plan.locate(step)
    import torch

    # torch threads: Spark's OMP_NUM_THREADS=spark.task.cpus sets them; more threads than cores per task
    # oversubscribes the executor (a common cause of slow steps), so the line says how many this rank runs.
    log.log(level, "rank %d/%d: %d rows, %d steps/epoch x %d epochs, %d parameters, backend %s, ps.mode=%s, "
            "generation %d, starting at step %d (epoch %d, batch %d), torch threads %d", plan.rank,
            plan.world_size, loader.num_rows, plan.steps_per_epoch, plan.epochs, info.num_params, plan.backend,
            info.mode, plan.generation, step, first_epoch, skip, torch.get_num_threads())
    for epoch in range(first_epoch, plan.epochs):
        epoch_started, epoch_cpu = time.perf_counter(), time.process_time()
        loss_sum, epoch_samples = 0.0, 0
        timer.start()
        for x, y in loader.epoch(epoch, start_step=skip if epoch == first_epoch else 0):
            faults.before_step(step)
            timer.lap("data_wait")
            if device != "cpu":
                x, y = to_device(x, device), y.to(device, non_blocking=True)
            timer.lap("to_device")
            exchange.zero_grad()
            if sparse is not None:
                sparse.before_forward(step)
            try:
                with precision.autocast():
                    batch_loss = faults.exploding(step, loss(forward(x), y))
            except Exception as exc:
                if keeps_its_type(exc):
                    raise
                raise model_input_error(exc, plan.model, rank=plan.rank, step=step, epoch=epoch,
                                        inputs=batch_inputs(x, y)) from exc
            timer.lap("forward")
            exchange.before_backward(step)  # ps.overlap: buckets go out as backward fills them
            precision.backward(batch_loss)
            # The one device sync of a step, taken before the exchange: a NaN/Inf loss stops here,
            # before its gradient reaches the server or the replicas step on it.
            value = batch_loss.item()
            check_finite(value, rank=plan.rank, step=step, epoch=epoch)
            timer.lap("backward")
            faults.applied(epoch, step, x, y)  # faults.record_rows_dir (a test hook; off: a no-op)
            if sparse is not None:
                sparse.after_backward(step)  # before the dense push: sync applies both with step t
            step = exchange.after_backward(step)
            timer.lap("exchange_other")
            loss_sum += value * len(y)
            epoch_samples += len(y)
            logs.tick()
            timer.lap("metrics_logs")
        # The loader's end of epoch (its last hand-off, its thread joined) is waiting on data: without this
        # lap it fell into other_ms, up to 10% of an 8-step epoch of 2 ms steps on a loaded box.
        timer.lap("data_wait")
        seconds = time.perf_counter() - epoch_started
        # This process's CPU seconds (every thread: loader, gloo) in the epoch: steadier than wall on a shared box.
        cpu_s = time.process_time() - epoch_cpu
        last_loss = loss_sum / max(epoch_samples, 1)
        samples += epoch_samples
        epoch_steps = plan.steps_per_epoch - (skip if epoch == first_epoch else 0)
        metrics = {"epoch": epoch, "step": step, "train_loss": last_loss, "samples": epoch_samples,
                   "seconds": seconds, "cpu_s": cpu_s, "step_time_s": seconds / max(epoch_steps, 1), **exchange.stats.take(),
                   **timer.take(seconds, epoch_steps), **(sparse.take_stats() if sparse is not None else {})}
        if validation is not None:
            metrics.update(evaluate_part(model, loss, weight_of, validation, plan.task))
        log.log(level, "rank %d epoch %d: loss %.4f, %.0f samples/s", plan.rank, epoch, last_loss,
                epoch_samples / max(seconds, 1e-9))
        exchange.end_epoch(step)  # buffers to the server, before the report a checkpoint waits for
        logs.report(metrics)
    digest = parameters = buffers = None
    if plan.backend == "allreduce":
        digest, parameters, buffers = final_parameters(model, keep=plan.rank == 0)
    return WorkerResult(rank=plan.rank, steps=step, samples=samples, seconds=time.perf_counter() - started,
                        final_train_loss=last_loss, device=device, parameters_digest=digest, parameters=parameters,
                        buffers=buffers)
