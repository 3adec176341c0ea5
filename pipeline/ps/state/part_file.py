"""One shard's part of a checkpoint set, written by the shard itself (``ps.placement: hosts``).

Why the shards write: the driver would otherwise pull every slice over its own link and push the whole
model out again to the checkpoint store, 2M bytes through one link per checkpoint. Each shard writes its
slice (parameters, optimizer state, its part of the sparse tables, its version) to ``<directory>/<name>``
on the run's checkpoint store (fsspec: a local path, or an object store every host reaches), and returns
its SHA-256 and version. The driver records those digests in the checkpoint file it commits, so a part is
held against a digest that the checkpoint's own digest (an HMAC under ``$SHARDLINE_ARTIFACT_KEY`` when set,
which the executors need not have) covers, and a reader verifies a part before a byte of it is unpickled
(``pipeline.checkpoints.CheckpointStore.load``). A part is a ``torch.save``'d dict of tensors and plain
values, loaded with ``weights_only=True``.
"""
from __future__ import annotations

import hashlib
import io
import re
import time
from typing import Any

PART_FORMAT = 1


def part_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_part(state: dict[str, Any], directory: str, name: str) -> dict[str, Any]:
    """Write ``state`` (a shard's ``state_dict()``) as ``<directory>/<name>``; returns what the checkpoint
    file records of it: ``file`` (the name), ``digest``, ``bytes``, ``version``, and the small per-rank
    records every shard holds alike (``clocks``, ``steps_applied_by_rank``, ``optimizer_spec``)."""
    import torch
    from fsspec.core import url_to_fs

    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or ".." in name:
        raise ValueError(f"a checkpoint part's name must be a plain file name, got {name!r}")
    buffer = io.BytesIO()
    torch.save({**state, "part_format": PART_FORMAT, "saved_at": time.time()}, buffer)
    data = buffer.getvalue()
    fs, root = url_to_fs(directory.rstrip("/"))
    fs.makedirs(root, exist_ok=True)
    # A part is read only through the checkpoint file that names it, committed after every part is whole,
    # so writing it under its final name is safe on disks and object stores alike.
    with fs.open(f"{root}/{name}", "wb") as out:
        out.write(data)
    return {"file": name, "digest": part_digest(data), "bytes": len(data), "version": int(state["version"]),
            "clocks": state.get("clocks"), "steps_applied_by_rank": state.get("steps_applied_by_rank"),
            "optimizer_spec": state.get("optimizer_spec")}
