"""The barrier-task body: runs one worker and returns its outcome as an Arrow row, never raising.

Returning failures as rows (instead of raising) keeps Spark's barrier stage from being torn down
before every rank has told the driver what happened, and lets the error carry the rank's log tail.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import traceback
from typing import Callable, Iterator

RESULT_SCHEMA = ("rank int, ok boolean, error string, log_tail string, "
                 "steps long, samples long, seconds double, final_train_loss double, process string, "
                 "device string, gpu string, parameters_digest string, parameters binary")


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


def make_task_fn(plans: list[dict], ps_host: str, ps_port: int, secret: bytes,
                 log_tail_lines: int) -> Callable[[Iterator], Iterator]:
    """Build the mapInArrow body from plain values only (no SparkSession, no self in the closure)."""

    def task(batches: Iterator) -> Iterator:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:  # the input frame only fixes the number of tasks
            pass
        context = BarrierTaskContext.get()
        rank = context.partitionId()
        plan = plans[rank]
        gpu = assigned_gpu(context.resources())
        rendezvous = None
        if plan["backend"] == "allreduce":
            rendezvous, error = _rendezvous(context, rank, plan["ps_timeout_s"])
            if error is not None:
                yield pa.RecordBatch.from_pylist([_failure_row(rank, error, "")], schema=_arrow_schema())
                return
        row = run_rank(plan, ps_host, ps_port, secret, log_tail_lines, gpu=gpu, rendezvous=rendezvous)
        yield pa.RecordBatch.from_pylist([row], schema=_arrow_schema())

    return task


def assigned_gpu(resources) -> str | None:
    """The GPU address Spark gave this task (spark.task.resource.gpu.amount), or None."""
    gpu = resources.get("gpu") if resources else None
    addresses = list(getattr(gpu, "addresses", []) or [])
    return str(addresses[0]) if addresses else None


def choose_device(gpu: str | None) -> str:
    """cuda:<address> for the task's GPU when CUDA works here, else cpu (logged: a GPU was asked for)."""
    if gpu is None:
        return "cpu"
    import torch

    if torch.cuda.is_available() and gpu.isdigit() and int(gpu) < torch.cuda.device_count():
        return f"cuda:{gpu}"
    logging.getLogger(__name__).warning("Spark assigned GPU %s to this task but CUDA cannot use it here "
                                        "(torch.cuda.is_available()=%s); training on cpu", gpu,
                                        torch.cuda.is_available())
    return "cpu"


def _rendezvous(context, rank: int, timeout_s: float):
    """Rank 0 offers its executor's host and a free port; every task learns it through one allGather.
    Returns (Rendezvous, None) or (None, error text)."""
    import json

    from pipeline.worker.distributed import Rendezvous

    offer = ""
    if rank == 0:
        host = context.getTaskInfos()[0].address.rsplit(":", 1)[0]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        offer = json.dumps({"host": host, "port": port})
    try:
        messages = context.allGather(offer)
    except Exception as exc:  # noqa: BLE001 - reported as this rank's failure row
        return None, f"allreduce rendezvous: the barrier allGather failed: {type(exc).__name__}: {exc}"
    found = json.loads(messages[0])
    return Rendezvous(found["host"], int(found["port"]), timeout_s), None


def _failure_row(rank: int, error: str, tail: str, process: str = "") -> dict:
    return {"rank": rank, "ok": False, "error": error, "log_tail": tail, "steps": None, "samples": None,
            "seconds": None, "final_train_loss": None, "process": process, "device": None, "gpu": None,
            "parameters_digest": None, "parameters": None}


def _arrow_schema():
    import pyarrow as pa

    return pa.schema([("rank", pa.int32()), ("ok", pa.bool_()), ("error", pa.string()), ("log_tail", pa.string()),
                      ("steps", pa.int64()), ("samples", pa.int64()), ("seconds", pa.float64()),
                      ("final_train_loss", pa.float64()), ("process", pa.string()), ("device", pa.string()),
                      ("gpu", pa.string()), ("parameters_digest", pa.string()), ("parameters", pa.binary())])


def run_rank(plan_dict: dict, ps_host: str, ps_port: int, secret: bytes, log_tail_lines: int, *,
             gpu: str | None = None, rendezvous=None) -> dict:
    """Run the worker for one rank; on failure return the error and this rank's log tail as the row."""
    from pipeline.worker import WorkerPlan, run

    plan = WorkerPlan.from_dict(plan_dict)
    # host:parent-pid/pid — Python workers fork from one daemon per executor, so the parent pid tells
    # executors apart on one host.
    process = f"{socket.gethostname()}:{os.getppid()}/{os.getpid()}"
    logger = logging.getLogger("pipeline")
    handler = _TailHandler(log_tail_lines)
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        device = choose_device(gpu)
        result = run(plan, ps_host, ps_port, secret, device=device, rendezvous=rendezvous,
                     log_tail=lambda: "\n".join(handler.lines))
        return {"rank": plan.rank, "ok": True, "error": None, "log_tail": None, "steps": result.steps,
                "samples": result.samples, "seconds": result.seconds, "final_train_loss": result.final_train_loss,
                "process": process, "device": result.device, "gpu": gpu,
                "parameters_digest": result.parameters_digest, "parameters": result.parameters}
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the driver as a row
        error = f"{type(exc).__name__}: {exc}"
        logger.error("rank %d failed: %s\n%s", plan.rank, error, traceback.format_exc())
        return {**_failure_row(plan.rank, error, "\n".join(handler.lines), process), "gpu": gpu}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)

