"""The barrier-task body: runs one worker and returns its outcome as an Arrow row, never raising.

Returning failures as rows (instead of raising) keeps Spark's barrier stage from being torn down
before every rank has told the driver what happened, and lets the error carry the rank's log tail.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import socket
import traceback
from typing import Callable, Iterator

RESULT_SCHEMA = ("rank int, ok boolean, error string, log_tail string, "
                 "steps long, samples long, seconds double, final_train_loss double, process string, "
                 "device string, gpu string, parameters_digest string, chunk int, parameters binary, "
                 "ps_report string")
# Parameters travel as rows of at most this many bytes (chunk 0 carries the rank's other fields), so a
# large model never meets Arrow's 2 GiB-per-array or Spark's per-row limits.
CHUNK_BYTES = 32 << 20


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


def make_task_fn(plans: list[dict], ps_host: str | None, ps_port: int | None, secret: bytes,
                 log_tail_lines: int, hosted: dict | None = None) -> Callable[[Iterator], Iterator]:
    """Build the mapInArrow body from plain values only (no SparkSession, no self in the closure).

    hosted (a task_ps.HostedPSSpec as a dict) means ps.placement=task: rank 0's task starts the PS and
    every task learns its address from the barrier's allGather; ps_host/ps_port are then None."""

    def task(batches: Iterator) -> Iterator:
        from pyspark import BarrierTaskContext

        for _ in batches:  # the input frame only fixes the number of tasks
            pass
        context = BarrierTaskContext.get()
        rank = context.partitionId()
        plan = plans[rank]
        gpu = assigned_gpu(context.resources())
        needs_allreduce = plan["backend"] == "allreduce"
        pipeline = plan["extra"].get("pipeline")
        if not needs_allreduce and hosted is None and pipeline is None:
            yield from _batches(run_rank(plan, ps_host, ps_port, secret, log_tail_lines, gpu=gpu))
            return
        # Import what training needs before the rendezvous: a fresh Python worker's torch import must not
        # eat into the deadlines that start there (a peer's PS wait, the connect watchdog).
        from pipeline.worker import loop as _preloaded  # noqa: F401

        host_ps = listener = None
        try:
            offer_error = None
            if rank == 0 and hosted is not None:
                host_ps, offer_error = _start_hosted_ps(context, hosted, secret)
            if pipeline is not None and pipeline["stage"] > 0 and offer_error is None:
                listener, offer_error = _stage_listener(context, rank, plan, secret)
            found, error = _rendezvous(context, rank, plan, ps=host_ps.server.address if host_ps is not None else None,
                                       link=listener.address if listener is not None else None,
                                       offer_error=offer_error)
            if error is not None:
                yield from _batches(_failure_row(rank, error, ""))
                return
            if host_ps is not None:
                host_ps.watch()
            address = found.get("ps") or (ps_host, ps_port)
            if pipeline is not None and pipeline.get("ps"):
                address = pipeline["ps"]  # this stage's server
            wiring = None
            if pipeline is not None:
                from pipeline.worker.stage_loop import StageWiring

                wiring = StageWiring(listener, found.get("next_link"))  # closed by the stage loop, and below
            row = run_rank(plan, address[0], int(address[1]), secret, log_tail_lines, gpu=gpu,
                           rendezvous=found.get("allreduce"), wiring=wiring)
            if host_ps is not None:
                host_ps.wait_for_peers()
                report = host_ps.report(failed=not row["ok"])
                stuck = host_ps.stuck_ranks()
                if stuck:
                    from pipeline.launch.task_ps import failure_error

                    if not row["ok"]:  # rank 0's own error says more than the PS's "closed its connection"
                        report["failures"][str(rank)] = [row["error"], row["log_tail"] or ""]
                    raise failure_error(report, stuck)
                row["ps_report"] = _encode_report(report)
                if plan["backend"] == "ps":
                    row["parameters"] = host_ps.parameters_bytes()
            yield from _batches(row)
        finally:
            if listener is not None:
                listener.close()
            if host_ps is not None:
                host_ps.__exit__(None, None, None)

    return task


def _start_hosted_ps(context, hosted: dict, secret: bytes):
    """Rank 0: start the PS on this executor's address; (HostedPS, None) or (None, error text)."""
    from pipeline.launch.task_ps import HostedPS, HostedPSSpec

    try:
        return HostedPS(HostedPSSpec(**hosted), _own_host(context, 0), secret).__enter__(), None
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the allGather
        logging.getLogger(__name__).exception("rank 0 could not start the parameter server")
        return None, f"rank 0 could not start the parameter server (ps.placement=task): {type(exc).__name__}: {exc}"


def _encode_report(report: dict) -> str:
    from pipeline.launch.task_ps import encode_report

    return encode_report(report)


def _batches(row: dict) -> Iterator:
    """One rank's result as record batches: chunk 0 with every field, then the rest of its parameters."""
    import pyarrow as pa

    schema = _arrow_schema()
    raw = row.get("parameters")
    pieces = [raw[i:i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES)] if raw else [raw]
    yield pa.RecordBatch.from_pylist([{**row, "chunk": 0, "parameters": pieces[0]}], schema=schema)
    for index, piece in enumerate(pieces[1:], start=1):
        yield pa.RecordBatch.from_pylist([{"rank": row["rank"], "chunk": index, "parameters": piece}], schema=schema)


def merge_chunks(rows: list[dict]) -> list[dict]:
    """The driver's inverse of _batches: one dict per rank with its parameters reassembled."""
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], []).append(row)
    merged = []
    for rank, parts in sorted(by_rank.items()):
        parts.sort(key=lambda r: r["chunk"] or 0)
        if [p["chunk"] or 0 for p in parts] != list(range(len(parts))):
            raise ValueError(f"rank {rank} returned parameter chunks {[p['chunk'] for p in parts]}, expected "
                             f"0..{len(parts) - 1}")
        head = dict(parts[0])
        if head.get("parameters") is not None:
            head["parameters"] = b"".join(bytes(p["parameters"]) for p in parts)
        head.pop("chunk", None)
        merged.append(head)
    return merged


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


def _own_host(context, rank: int) -> str:
    return context.getTaskInfos()[rank].address.rsplit(":", 1)[0]


def _stage_listener(context, rank: int, plan: dict, secret: bytes):
    """A pipeline stage > 0 listens for the previous stage's link on its executor's address."""
    from pipeline.parallel.link import StageListener

    try:
        listener = StageListener(_own_host(context, rank), secret, plan["generation"],
                                 stage=plan["extra"]["pipeline"]["stage"], rank=rank, expect_rank=rank - 1,
                                 timeout_s=plan["ps_timeout_s"])
        return listener, None
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the allGather
        return None, f"rank {rank} could not listen for its pipeline link: {type(exc).__name__}: {exc}"


def _rendezvous(context, rank: int, plan: dict, *, ps=None, link=None, offer_error=None):
    """One allGather for everything the tasks must agree on. Each rank offers what it hosts: rank 0 the
    task-hosted PS (ps.placement=task); a pipeline stage > 0 its link listener; the first task of each
    allreduce group (rank 0, or replica 0 of each pipeline stage) a free port on its host for the group's
    rendezvous. Returns ({"ps"?, "allreduce"?, "next_link"?}, None) or (None, error text)."""
    from pipeline.worker.distributed import Rendezvous

    pipeline = plan["extra"].get("pipeline")
    stages = pipeline["stages"] if pipeline else 1
    leader = rank % stages if pipeline else 0  # the allreduce group's first rank
    offer = {}
    if offer_error is not None:
        offer["error"] = offer_error
    if ps is not None:
        offer["ps"] = list(ps)
    if link is not None:
        offer["link"] = list(link)
    probe = None
    if plan["backend"] == "allreduce" and rank == leader:
        host = _own_host(context, rank)
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
    found = {}
    if "ps" in offers[0]:
        found["ps"] = offers[0]["ps"]
    if plan["backend"] == "allreduce":
        host, port = offers[leader]["allreduce"]
        found["allreduce"] = Rendezvous(host, int(port), plan["ps_timeout_s"])
    if pipeline and pipeline["stage"] < stages - 1:
        found["next_link"] = tuple(offers[rank + 1]["link"])
    return found, None


def _failure_row(rank: int, error: str, tail: str, process: str = "") -> dict:
    return {"rank": rank, "ok": False, "error": error, "log_tail": tail, "steps": None, "samples": None,
            "seconds": None, "final_train_loss": None, "process": process, "device": None, "gpu": None,
            "parameters_digest": None, "chunk": 0, "parameters": None, "ps_report": None}


def _arrow_schema():
    import pyarrow as pa

    return pa.schema([("rank", pa.int32()), ("ok", pa.bool_()), ("error", pa.string()), ("log_tail", pa.string()),
                      ("steps", pa.int64()), ("samples", pa.int64()), ("seconds", pa.float64()),
                      ("final_train_loss", pa.float64()), ("process", pa.string()), ("device", pa.string()),
                      ("gpu", pa.string()), ("parameters_digest", pa.string()), ("chunk", pa.int32()),
                      ("parameters", pa.binary()), ("ps_report", pa.string())])


def run_rank(plan_dict: dict, ps_host: str, ps_port: int, secret: bytes, log_tail_lines: int, *,
             gpu: str | None = None, rendezvous=None, wiring=None) -> dict:
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
                     log_tail=lambda: "\n".join(handler.lines), wiring=wiring)
        return {"rank": plan.rank, "ok": True, "error": None, "log_tail": None, "steps": result.steps,
                "samples": result.samples, "seconds": result.seconds, "final_train_loss": result.final_train_loss,
                "process": process, "device": result.device, "gpu": gpu,
                "parameters_digest": result.parameters_digest, "parameters": result.parameters, "ps_report": None}
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the driver as a row
        error = f"{type(exc).__name__}: {exc}"
        pipeline = plan.extra.get("pipeline")
        if pipeline:  # name the stage too: a pipeline failure is located by (rank, stage)
            error = (f"stage {pipeline['stage']} of {pipeline['stages']} (replica {pipeline['replica']}): "
                     f"{error}")
        logger.error("rank %d failed: %s\n%s", plan.rank, error, traceback.format_exc())
        return {**_failure_row(plan.rank, error, "\n".join(handler.lines), process), "gpu": gpu}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)

