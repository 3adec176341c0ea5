"""The per-task training loop: pull parameters, forward/backward on the local shard, push gradients.

No Spark here: the loop only needs its plan, the PS address and the run's secret, so it can be tested
in plain threads or processes.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

from pipeline.worker.plan import WorkerPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerResult:
    rank: int
    steps: int
    samples: int
    seconds: float
    final_train_loss: float
    device: str = "cpu"
    # allreduce: sha256 of this rank's final parameters (replicas must agree) and, on rank 0, the
    # parameters themselves as raw little-endian float32 bytes (the merged model).
    parameters_digest: Optional[str] = None
    parameters: Optional[bytes] = None


def _evaluate(model, loss, features, labels, task: str) -> dict[str, float]:
    import torch

    model.eval()
    with torch.no_grad():
        output = model(features)
        metrics = {"val_loss": float(loss(output, labels))}
        if task == "classification":
            metrics["val_accuracy"] = float((output.argmax(dim=1) == labels).float().mean())
    model.train()
    return metrics


class InjectedFault(RuntimeError):
    """Raised by the fault-injection hook (faults.fail_rank / faults.fail_step); off by default."""


def _inject_faults(plan: WorkerPlan, step: int) -> None:
    """The faults.* hooks (plan.extra["faults"], present only in the attempts they apply to)."""
    faults = plan.extra.get("faults")
    if not faults:
        return
    if faults.get("delay_rank") == plan.rank and step >= faults.get("delay_step", 0):
        time.sleep(faults.get("delay_ms", 0.0) / 1000.0)
    if faults.get("kill_rank") == plan.rank and step >= faults.get("kill_step", 0):
        import os
        import signal

        log.error("rank %d: faults.kill_rank: SIGKILL to this Python worker (pid %d) at step %d",
                  plan.rank, os.getpid(), step)
        os.kill(os.getpid(), signal.SIGKILL)
    if (faults.get("fail_rank") == plan.rank and not faults.get("fail_in_rendezvous")
            and step >= faults.get("fail_step", 0)):
        raise InjectedFault(f"injected failure on rank {plan.rank} at step {step} (faults.fail_rank)")


def _maybe_slow_down(plan: WorkerPlan) -> None:
    """Test hook (plan.extra["slow_rank"], ["slow_s"]): make one rank slow, e.g. to exercise ssp's bound."""
    if plan.extra.get("slow_rank") == plan.rank:
        time.sleep(float(plan.extra.get("slow_s", 0.0)))


class _LogForwarder(logging.Handler):
    """Buffers this worker's log lines for the driver; `take()` hands them over (best effort)."""

    def __init__(self, level: int, limit: int = 200):
        super().__init__(level)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._lines: list[str] = []
        self._limit = limit
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if len(self._lines) < self._limit:
                self._lines.append(self.format(record))
            else:
                self.dropped += 1
        except Exception:  # a log line must never fail training
            pass

    def take(self) -> list[str]:
        lines, self._lines = self._lines, []
        if self.dropped:
            lines.append(f"({self.dropped} more log lines dropped)")
            self.dropped = 0
        return lines


def _forward_logs(client, forwarder: _LogForwarder) -> None:
    lines = forwarder.take()
    if lines:
        try:
            client.report({"log": lines})
        except Exception:  # best effort: streaming logs never fails the job
            log.debug("could not forward %d log lines to the driver", len(lines), exc_info=True)


FORWARD_EVERY_S = 2.0


def make_train_loader(plan: WorkerPlan):
    """This rank's streaming loader: row groups read on demand, bounded shuffle buffer, prefetch thread.

    Loader settings (reader, shuffle, buffer, threads, the manifest's row-group counts) come from
    plan.extra["loader"]; without them the loader's defaults apply.
    """
    from pipeline.data import StreamingLoader

    return StreamingLoader(plan.train_files, steps_per_epoch=plan.steps_per_epoch, seed=plan.seed, rank=plan.rank,
                           features_field=plan.features_field, label_field=plan.label_field,
                           num_features=plan.num_features, prefetch=plan.prefetch, **plan.extra.get("loader", {}))


def run(plan: WorkerPlan, ps_host: str, ps_port: int, secret: bytes, *, device: str = "cpu",
        rendezvous=None, log_tail=None, wiring=None) -> WorkerResult:
    """Train this rank's share of the run; raise on any failure (the caller reports it).

    backend ps: gradients go to the server in its ``ps.mode``. backend allreduce: the model is wrapped in
    DistributedDataParallel over a process group joined at ``rendezvous`` (a worker.distributed.Rendezvous);
    the PS connection still carries metrics, failures and FINISH. ``device`` is where the model trains
    (``cuda:N`` for the GPU Spark assigned the task)."""
    import torch

    from pipeline.data import read_tensors
    from pipeline.models import ModelSpec, build_model, loss_fn
    from pipeline.ps import PSClient

    if plan.extra.get("pipeline"):  # parallelism.pipeline > 1: this task runs one stage of a replica
        from pipeline.worker.stage_loop import StageWiring, run_stage

        return run_stage(plan, ps_host, ps_port, secret, wiring or StageWiring(), device=device,
                         rendezvous=rendezvous, log_tail=log_tail)
    level = logging.INFO if plan.rank == 0 else logging.DEBUG
    torch.manual_seed(plan.seed + plan.rank)  # dropout masks differ per rank, reproducibly
    started = time.perf_counter()
    with PSClient(ps_host, ps_port, rank=plan.rank, secret=secret, generation=plan.generation,
                  timeout_s=plan.ps_timeout_s, log_tail=log_tail) as client:
        # Entering the client connects before anything that can fail; leaving it on an exception sends
        # FAIL, so the server frees the peers at once instead of letting them time out.
        info = client.connect()
        loader = make_train_loader(plan)
        validation = (read_tensors(plan.validation_files, plan.features_field, plan.label_field,
                                   plan.num_features) if plan.validation_files else None)
        if validation is not None:
            validation = (validation[0].to(device), validation[1].to(device))
        model = build_model(ModelSpec.from_dict(plan.model)).to(device)
        loss = loss_fn(plan.task)
        total_steps = plan.steps_per_epoch * plan.epochs
        group = _process_group(rendezvous, plan, device) if plan.backend == "allreduce" else nullcontext()
        with group:
            try:
                result = _train(plan, client, info, model, loss, loader, validation, total_steps, device, level,
                                started)
            except BaseException as exc:
                # Before the process group goes: its teardown breaks the peers' collectives, and their
                # FAILs must not reach the server ahead of this rank's cause.
                client.report_failure(exc)
                raise
        client.finish()
    return result


def _process_group(rendezvous, plan: WorkerPlan, device: str):
    from pipeline.worker.distributed import process_group

    if rendezvous is None:
        raise ValueError("train.backend=allreduce needs a rendezvous address (given by the barrier task)")
    faults = plan.extra.get("faults") or {}
    if faults.get("fail_in_rendezvous") and faults.get("fail_rank") == plan.rank:
        raise InjectedFault(f"injected failure on rank {plan.rank} while joining the allreduce process group "
                            "(faults.fail_in_rendezvous)")
    return process_group(rendezvous, plan.rank, plan.world_size, device)


def _train(plan: WorkerPlan, client, info, model, loss, loader, validation, total_steps: int, device: str,
           level: int, started: float) -> WorkerResult:
    # Rank 0's INFO lines and every rank's warnings go to the driver's log while training runs.
    forwarder = _LogForwarder(logging.INFO if plan.rank == 0 else logging.WARNING)
    logging.getLogger("pipeline").addHandler(forwarder)
    try:
        return _train_loop(plan, client, info, model, loss, loader, validation, total_steps, device, level,
                           started, forwarder)
    finally:
        logging.getLogger("pipeline").removeHandler(forwarder)


def _train_loop(plan: WorkerPlan, client, info, model, loss, loader, validation, total_steps: int, device: str,
                level: int, started: float, forwarder: _LogForwarder) -> WorkerResult:
    import torch

    from pipeline.worker.exchange import make_exchange

    samples = 0
    last_loss = float("nan")
    last_forward = time.monotonic()
    exchange = make_exchange(client, info, model, total_steps, plan.optimizer, plan.backend)
    step = exchange.start()
    forward = model
    if plan.backend == "allreduce":
        from torch.nn.parallel import DistributedDataParallel

        # Bucketed gradient allreduce overlapped with backward; grads land averaged in model's .grad.
        forward = DistributedDataParallel(model, device_ids=[torch.device(device).index] if device.startswith("cuda")
                                          else None)
    # A retried attempt (new generation) starts at the server's step for this rank; the epoch and the
    # batch within it follow from it, so no sample is skipped or trained on twice.
    first_epoch, skip = divmod(step, plan.steps_per_epoch)
    log.log(level, "rank %d/%d: %d rows, %d steps/epoch x %d epochs, %d parameters, ps.mode=%s, "
            "generation %d, starting at step %d (epoch %d, batch %d)", plan.rank, plan.world_size,
            loader.num_rows, plan.steps_per_epoch, plan.epochs, info.num_params, info.mode,
            plan.generation, step, first_epoch, skip)
    for epoch in range(first_epoch, plan.epochs):
        epoch_started = time.perf_counter()
        loss_sum, epoch_samples = 0.0, 0
        for x, y in loader.epoch(epoch, start_step=skip if epoch == first_epoch else 0):
            _inject_faults(plan, step)
            _maybe_slow_down(plan)
            if device != "cpu":
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for p in model.parameters():
                p.grad = None
            batch_loss = loss(forward(x), y)
            batch_loss.backward()
            step = exchange.after_backward(step)
            loss_sum += batch_loss.item() * len(x)
            epoch_samples += len(x)
            if time.monotonic() - last_forward > FORWARD_EVERY_S:
                _forward_logs(client, forwarder)
                last_forward = time.monotonic()
        seconds = time.perf_counter() - epoch_started
        last_loss = loss_sum / max(epoch_samples, 1)
        samples += epoch_samples
        epoch_steps = plan.steps_per_epoch - (skip if epoch == first_epoch else 0)
        metrics = {"epoch": epoch, "step": step, "train_loss": last_loss, "samples": epoch_samples,
                   "seconds": seconds, "step_time_s": seconds / max(epoch_steps, 1), **exchange.stats.take()}
        if validation is not None:
            metrics.update(_evaluate(model, loss, validation[0], validation[1], plan.task))
        log.log(level, "rank %d epoch %d: loss %.4f, %.0f samples/s", plan.rank, epoch, last_loss,
                epoch_samples / max(seconds, 1e-9))
        client.report({**metrics, "log": forwarder.take()})
        last_forward = time.monotonic()
    digest = parameters = None
    if plan.backend == "allreduce":
        import hashlib

        from pipeline.models import flat_parameters

        flat = flat_parameters(model).cpu().contiguous()
        raw = flat.numpy().tobytes()
        digest = hashlib.sha256(raw).hexdigest()
        parameters = raw if plan.rank == 0 else None
    return WorkerResult(rank=plan.rank, steps=step, samples=samples, seconds=time.perf_counter() - started,
                        final_train_loss=last_loss, device=device, parameters_digest=digest, parameters=parameters)
