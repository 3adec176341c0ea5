"""Committing a shard set on an object store, where there is no rename: write the files, publish the manifest.

    <target>/manifest.json                         the published set; names its data prefix
    <target>/data-<UTC time, µs>-<hex8>/split=.../     one ETL attempt's files (fresh prefix per attempt)

An ETL writes every file under a fresh prefix nobody reads, then PUTs manifest.json last. A single PUT is
atomic, so a reader (which trusts only the published manifest) sees the old set or the new one, never a
half-written one; a failed or killed ETL leaves an unreferenced prefix and the old set untouched. After
publishing, prefixes older than the new one are garbage-collected, except the one the previous manifest
named: a reader that loaded it a moment before the publish can still finish its epoch (it goes with the
next publish). Prefixes newer than the published one (another ETL still writing) are never touched.
"""
from __future__ import annotations

import datetime
import json
import logging
import uuid
from typing import Optional

from pipeline import storage
from pipeline.shards.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)

PREFIX = "data-"


def fresh_prefix() -> str:
    """A new attempt's prefix: sorts by creation time, unique across concurrent writers. Microseconds, because
    two attempts within one second (a failed ETL retried at once) must still sort in creation order, or the
    garbage collection would take the older one for a newer writer's and keep it."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    return f"{PREFIX}{stamp}-{uuid.uuid4().hex[:8]}"


def published_prefix(target: str) -> Optional[str]:
    """The data prefix the currently published manifest names (None: nothing published, or a local-layout set)."""
    try:
        data = json.loads(storage.read_bytes(storage.join(target, MANIFEST_NAME)))
    except (FileNotFoundError, ValueError):
        return None
    return data.get("data_prefix") or None


def collect_garbage(target: str, published: str, keep: Optional[str]) -> list[str]:
    """Delete the data prefixes under `target` older than `published`, except `keep`; returns them."""
    stale = [name for name in storage.list_dirs(target)
             if name.startswith(PREFIX) and name < published and name != keep]
    for name in stale:
        storage.delete_dir(storage.join(target, name))
    if stale:
        log.info("removed %d stale shard prefix(es) under %s", len(stale), target)
    return stale


def remove_unreported(folder: str, reported: set[str]) -> int:
    """Delete the .parquet files under `folder` no successful task attempt reported (failed or speculative
    attempts); `reported` holds filesystem paths as the writers returned them."""
    fs, _ = storage.resolve(folder)
    stray = [path for path in storage.list_files(folder) if path.endswith(".parquet") and path not in reported]
    for path in stray:
        fs.delete_file(path)
    return len(stray)
