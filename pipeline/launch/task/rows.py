"""The contract between a barrier task and the driver: one rank's outcome as Arrow rows.

Returning failures as rows (instead of raising) keeps Spark's barrier stage from being torn down before
every rank has told the driver what happened, and lets the error carry the rank's log tail. Parameters
travel chunked, so a large model never meets Arrow's 2 GiB-per-array or Spark's per-row limits.
"""
from __future__ import annotations

import base64
import json
import os
import re
from typing import Iterator, Optional

RESULT_SCHEMA = ("rank int, ok boolean, error string, log_tail string, retryable boolean, "
                 "steps long, samples long, seconds double, final_train_loss double, process string, "
                 "device string, gpu string, parameters_digest string, chunk int, parameters binary, "
                 "ps_report string, buffers binary, address string, package string")
# Parameters travel as rows of at most this many bytes (chunk 0 carries the rank's other fields).
CHUNK_BYTES = 32 << 20
_REPORT_TAG = "shardline-task-ps-failure:"
_MAX_EMBEDDED = 6000


def failure_row(rank: int, error: Optional[str], tail: str, process: str = "", retryable: bool = True) -> dict:
    return {"rank": rank, "ok": False, "error": error, "log_tail": tail, "retryable": retryable, "steps": None,
            "samples": None, "seconds": None, "final_train_loss": None, "process": process, "device": None,
            "gpu": None, "parameters_digest": None, "chunk": 0, "parameters": None, "ps_report": None,
            "buffers": None, **task_origin()}


def task_origin() -> dict:
    """Where this rank ran and what it ran: its executor's address as Spark knows it (None outside a
    barrier task), and the file `pipeline` was imported from, which on a cluster must be what spark-submit
    shipped (--py-files, --archives) or the cluster image, never a driver-side checkout."""
    import pipeline

    address = None
    try:
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        if context is not None:
            address = context.getTaskInfos()[context.partitionId()].address.rsplit(":", 1)[0]
    except Exception:  # not in a barrier task (a test calling run_rank directly): no address to report
        address = None
    return {"address": address, "package": os.path.abspath(pipeline.__file__)}  # relative to the executor cwd


def arrow_schema():
    import pyarrow as pa

    return pa.schema([("rank", pa.int32()), ("ok", pa.bool_()), ("error", pa.string()), ("log_tail", pa.string()),
                      ("retryable", pa.bool_()), ("steps", pa.int64()), ("samples", pa.int64()),
                      ("seconds", pa.float64()), ("final_train_loss", pa.float64()), ("process", pa.string()),
                      ("device", pa.string()), ("gpu", pa.string()), ("parameters_digest", pa.string()),
                      ("chunk", pa.int32()), ("parameters", pa.binary()), ("ps_report", pa.string()),
                      # The model's buffers (pipeline.models.state), in chunk 0: small next to parameters.
                      ("buffers", pa.binary()), ("address", pa.string()), ("package", pa.string())])


def to_batches(row: dict) -> Iterator:
    """One rank's result as record batches: chunk 0 with every field, then the rest of its parameters."""
    import pyarrow as pa

    schema = arrow_schema()
    raw = row.get("parameters")
    pieces = [raw[i:i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES)] if raw else [raw]
    yield pa.RecordBatch.from_pylist([{**row, "chunk": 0, "parameters": pieces[0]}], schema=schema)
    for index, piece in enumerate(pieces[1:], start=1):
        yield pa.RecordBatch.from_pylist([{"rank": row["rank"], "chunk": index, "parameters": piece}], schema=schema)


def merge_chunks(rows: list[dict]) -> list[dict]:
    """The driver's inverse of to_batches: one dict per rank with its parameters reassembled."""
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


def encode_report(report: dict) -> str:
    return json.dumps(report, default=str)


def embed_failure_report(reason: str, report: dict) -> str:
    """``reason`` plus a compact copy of the task PS's failure account, for an exception message that only
    reaches the driver as Spark's error text (when rank 0 itself must fail the stage)."""
    failures = {r: [e[:400], "\n".join((t or "").splitlines()[-15:])[:1500], *retryable]
                for r, (e, t, *retryable) in list(report.get("failures", {}).items())[:8]}
    compact = {"root_failures": report.get("root_failures", []), "failures": failures, "reason": reason}
    encoded = base64.b64encode(json.dumps(compact).encode())[:_MAX_EMBEDDED].decode()
    return f"{reason} {_REPORT_TAG}{encoded}"


def failure_of(rank: int, entry: list):
    """A WorkerFailure from a report's ``[error, log tail, retryable?]`` entry."""
    from pipeline.errors import WorkerFailure

    error, tail, *rest = entry
    return WorkerFailure(rank, str(error), str(tail or ""), rest[0] is not False if rest else True)


def decode_failure_report(text: str) -> Optional[dict]:
    """The compact failure account embedded in Spark's error text, if any."""
    found = re.search(re.escape(_REPORT_TAG) + r"([A-Za-z0-9+/=]+)", text)
    if not found:
        return None
    try:
        return json.loads(base64.b64decode(found.group(1)))
    except Exception:  # truncated on the way: the driver falls back to Spark's own error
        return None
