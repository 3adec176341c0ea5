"""A Delta table pinned at one version (delta-rs reads the log), as the files Spark's tasks read.

The log is replayed once, on the driver, at the start of the ETL: the version read is the one resolved
here even when a writer commits during the ETL. What the files alone would get wrong is applied, or the
read fails: column mapping (the files' physical names are mapped to the logical ones), deletion vectors
(each file's deleted rows, from delta-rs, dropped by the task) and partition values (typed constant
columns). Any other reader feature the table requires is an error naming it, never a silent wrong read.
"""
from __future__ import annotations

import logging
import os
from datetime import datetime
from typing import Optional
from urllib.parse import unquote

from pipeline.errors import TableError
from pipeline.tables.catalog import require
from pipeline.tables.pinned import DeltaFile, PinnedTable

log = logging.getLogger(__name__)

# Reader features this read honours: the rest fail loudly (a file read without them can return wrong rows).
HONOURED_FEATURES = {"deletionVectors", "columnMapping", "timestampNtz", "typeWidening", "typeWidening-preview",
                     "v2Checkpoint", "vacuumProtocolCheck"}


def _open(path: str, version: Optional[int], timestamp: Optional[datetime]):
    """(the table loaded at the pin, the pinned version's commit time in ms)."""
    deltalake = require("deltalake", "delta")
    from pipeline import storage

    if not deltalake.DeltaTable.is_deltatable(path):
        hint = ("; it holds Parquet files: read it with data.source=parquet, or convert it to Delta"
                if storage.exists(path) else "; the path does not exist")
        raise TableError(f"data.path {path} is not a Delta table (no _delta_log there){hint}")
    table = deltalake.DeltaTable(path)
    current = table.version()
    if version is not None:
        if version > current:
            raise TableError(f"Delta table {path} has no version {version} (its versions are up to {current}); set "
                             "data.version to one of them, or to null for the current one")
        try:
            table.load_as_version(version)
        except Exception as exc:  # a version the log no longer has (checkpointed, then its JSON cleaned up)
            raise TableError(f"Delta table {path} cannot load version {version} ({exc}); the log may have been "
                             "cleaned up past it: pick a newer data.version") from None
    elif timestamp is not None:
        try:
            table.load_as_version(timestamp)
            problem = None
        except Exception as exc:
            problem = str(exc)
        # delta-rs 1.6.6 loads version 0 for a time before the first commit: checked here, not trusted.
        committed = None if problem else _commit_ms(path, table.version())
        if problem or committed > timestamp.timestamp() * 1000:
            first = datetime.fromtimestamp(_commit_ms(path, 0) / 1000, tz=timestamp.tzinfo).isoformat()
            raise TableError(f"Delta table {path} has no version at data.timestamp={timestamp.isoformat()}"
                             f"{f' ({problem})' if problem else ''}: its first commit is at {first}; set a later "
                             "data.timestamp") from None
        return table, committed
    return table, _commit_ms(path, table.version())


def _partition_values(partition_columns: list[str], schema, row: dict) -> dict:
    """The add action's partition values (text in the log) typed as the schema's columns."""
    import pyarrow as pa

    values = {}
    for name in partition_columns:
        text = row.get(f"partition.{name}")
        arrow_type = schema.field(name).type
        values[name] = None if text is None else pa.array([text]).cast(arrow_type)[0].as_py()
    return values


def pin_delta(path: str, version: Optional[int], timestamp: Optional[datetime]) -> PinnedTable:
    """The table at `version`, at the version current at `timestamp`, or (both None) at its current version."""
    import pyarrow as pa

    table, committed = _open(path, version, timestamp)
    pinned = table.version()
    protocol = table.protocol()
    needed = set(protocol.reader_features or [])
    unknown = sorted(needed - HONOURED_FEATURES)
    if unknown:
        raise TableError(f"Delta table {path} at version {pinned} needs reader feature(s) {unknown}, which shardline's "
                         f"Delta read does not honour (it honours {sorted(HONOURED_FEATURES)}); reading the files "
                         "without them could return wrong or deleted rows. Rewrite the table without them")
    schema = pa.schema(table.schema().to_arrow())
    config = table.metadata().configuration or {}
    mapping_mode = config.get("delta.columnMapping.mode", "none")
    physical = {}
    if mapping_mode != "none":
        physical = {f.name: (f.metadata or {}).get(b"delta.columnMapping.physicalName", b"").decode() or f.name
                    for f in schema}
    partition_columns = list(table.metadata().partition_columns)
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    deleted = {}
    if "deletionVectors" in needed or protocol.min_reader_version >= 3:
        import numpy as np

        for batch in pa.RecordBatchReader.from_stream(table.deletion_vectors()):
            for row in batch.to_pylist():
                deleted[row["filepath"]] = tuple(int(i) for i in np.flatnonzero(~np.asarray(row["selection_vector"])))
    # Each file's location from its add action: delta-rs's file_uris() percent-encodes a local root ("a b" ->
    # "a%20b", a folder that does not exist), and the log's relative paths are URL-encoded once.
    base = path.rstrip("/") if "://" in path else os.path.abspath(path)
    table_url = table.table_uri.rstrip("/")
    files, matched = [], set()
    for action in actions:
        relative = action["path"]
        absolute = "://" in relative or relative.startswith("/")
        location = unquote(relative) if absolute else f"{base}/{unquote(relative)}"
        # Partition values are stored under the physical names where column mapping is on.
        values = _partition_values(partition_columns, schema, {
            f"partition.{name}": action.get(f"partition.{physical.get(name, name)}", action.get(f"partition.{name}"))
            for name in partition_columns})
        vector = relative if absolute else f"{table_url}/{relative}"  # how delta-rs names a vector's file
        if vector in deleted:
            matched.add(vector)
        files.append(DeltaFile(location, values, deleted.get(vector, ())))
    if set(deleted) - matched:  # a deletion vector no listed file claims: its rows would be read as if live
        raise TableError(f"Delta table {path} at version {pinned} has deletion vectors for files it does not list, "
                         f"e.g. {sorted(set(deleted) - matched)[0]}; shardline will not read it without them: "
                         "please report this")
    honoured = []
    if mapping_mode != "none":
        honoured.append(f"column mapping ({mapping_mode})")
    if any(f.deleted for f in files):
        dropped = [f for f in files if f.deleted]
        honoured.append(f"deletion vectors ({sum(len(f.deleted) for f in dropped)} rows in {len(dropped)} files)")
    log.info("Delta table %s: version %d (%d files%s)", path, pinned, len(files),
             f"; applying {', '.join(honoured)}" if honoured else "")
    return PinnedTable("delta", path, table.table_uri, pinned, committed, schema, tuple(files),
                       reader={"physical": physical, "partition_columns": partition_columns},
                       honoured=tuple(honoured), table_id=table.metadata().id)


def _commit_ms(path: str, version: int) -> int:
    """When `version` was committed. From the latest table's history: delta-rs 1.6.6 numbers the history of
    a time-travelled table from the loaded version down while listing the newest commits (wrong versions)."""
    import deltalake

    latest = deltalake.DeltaTable(path)
    for entry in latest.history(limit=latest.version() - version + 1):
        if entry.get("version") == version:
            return int(entry.get("timestamp") or 0)
    return 0
