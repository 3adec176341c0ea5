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
                 "steps long, samples long, seconds double, final_train_loss double, process string")


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
        rank = BarrierTaskContext.get().partitionId()
        row = run_rank(plans[rank], ps_host, ps_port, secret, log_tail_lines)
        yield pa.RecordBatch.from_pylist([row], schema=_arrow_schema())

    return task


def _arrow_schema():
    import pyarrow as pa

    return pa.schema([("rank", pa.int32()), ("ok", pa.bool_()), ("error", pa.string()), ("log_tail", pa.string()),
                      ("steps", pa.int64()), ("samples", pa.int64()), ("seconds", pa.float64()),
                      ("final_train_loss", pa.float64()), ("process", pa.string())])


def run_rank(plan_dict: dict, ps_host: str, ps_port: int, secret: bytes, log_tail_lines: int) -> dict:
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
        result = run(plan, ps_host, ps_port, secret)
        return {"rank": plan.rank, "ok": True, "error": None, "log_tail": None, "steps": result.steps,
                "samples": result.samples, "seconds": result.seconds, "final_train_loss": result.final_train_loss,
                "process": process}
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the driver as a row
        error = f"{type(exc).__name__}: {exc}"
        logger.error("rank %d failed: %s\n%s", plan.rank, error, traceback.format_exc())
        tail = "\n".join(handler.lines)
        return {"rank": plan.rank, "ok": False, "error": error, "log_tail": tail, "steps": None,
                "samples": None, "seconds": None, "final_train_loss": None, "process": process}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)

