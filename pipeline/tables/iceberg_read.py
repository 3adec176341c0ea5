"""An Iceberg table pinned at one snapshot (pyiceberg plans the scan), as the file tasks Spark's tasks read.

The snapshot is resolved and its files planned once, on the driver, at the start of the ETL; each Spark
task then reads its share of the planned FileScanTasks with pyiceberg's own ArrowScan (pickled to the task
with the table metadata and FileIO), so what pyiceberg honours is honoured: columns by field id (renames and
added columns across schema versions), positional delete files, identity partition columns. Equality deletes
(which pyiceberg's reader does not apply) fail the pin, naming the files, instead of reading deleted rows.
"""
from __future__ import annotations

import logging
from datetime import datetime
from typing import Optional

from pipeline.errors import TableError
from pipeline.tables.catalog import iceberg_table
from pipeline.tables.pinned import PinnedTable

log = logging.getLogger(__name__)


def _snapshot(table, identifier: str, snapshot_id: Optional[int], timestamp: Optional[datetime]):
    snapshots = table.snapshots()
    if not snapshots:
        raise TableError(f"Iceberg table {identifier} has no snapshot yet (nothing was ever committed to it); "
                         "write to it first")
    if snapshot_id is not None:
        snapshot = table.snapshot_by_id(snapshot_id)
        if snapshot is None:
            known = ", ".join(str(s.snapshot_id) for s in snapshots[-5:])
            raise TableError(f"Iceberg table {identifier} has no snapshot {snapshot_id} (the newest are {known}); set "
                             "data.snapshot_id to one of them, or to null for the current one")
        return snapshot
    if timestamp is not None:
        snapshot = table.snapshot_as_of_timestamp(int(timestamp.timestamp() * 1000))
        if snapshot is None:
            first = datetime.fromtimestamp(min(s.timestamp_ms for s in snapshots) / 1000, tz=timestamp.tzinfo)
            raise TableError(f"Iceberg table {identifier} has no snapshot at data.timestamp={timestamp.isoformat()}: "
                             f"its first snapshot is at {first.isoformat()}; set a later data.timestamp")
        return snapshot
    return table.current_snapshot()


def pin_iceberg(config, identifier: str, snapshot_id: Optional[int], timestamp: Optional[datetime]) -> PinnedTable:
    """The table `identifier` of the catalog `config` (IcebergConfig) at a snapshot, its files planned."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow
    from pyiceberg.manifest import DataFileContent

    table = iceberg_table(config, identifier)
    snapshot = _snapshot(table, identifier, snapshot_id, timestamp)
    scan = table.scan(snapshot_id=snapshot.snapshot_id)
    tasks = tuple(scan.plan_files())
    equality = [d.file_path for t in tasks for d in t.delete_files if d.content == DataFileContent.EQUALITY_DELETES]
    if equality:
        raise TableError(f"Iceberg table {identifier} at snapshot {snapshot.snapshot_id} has {len(equality)} equality "
                         f"delete file(s), e.g. {equality[0]}, which pyiceberg's reader does not apply: the read "
                         "would return deleted rows. Compact the table (rewrite_data_files) and pin the new snapshot")
    positional = {d.file_path for t in tasks for d in t.delete_files}
    projection = scan.projection()
    schema = _plain(schema_to_pyarrow(projection, include_field_ids=False))
    honoured = ["columns by field id"] + ([f"positional deletes ({len(positional)} files)"] if positional else [])
    log.info("Iceberg table %s: snapshot %d (%d data files%s)", identifier, snapshot.snapshot_id, len(tasks),
             f", {len(positional)} positional delete files applied" if positional else "")
    uri = f"iceberg://{config.name}/{identifier}"
    return PinnedTable("iceberg", identifier, uri, snapshot.snapshot_id, snapshot.timestamp_ms, schema, tasks,
                       reader={"metadata": table.metadata, "io": _io_without_secrets(table),
                               "projection": projection},
                       honoured=tuple(honoured), catalog=config.name, table_id=str(table.metadata.table_uuid))


def _io_without_secrets(table):
    """The table's FileIO as the Spark tasks get it (pickled into their closure): without the catalog's secret
    properties, which each executor takes from its own environment, as pipeline/storage's filesystems do."""
    from pyiceberg.io import load_file_io

    from pipeline.config.sources import is_secret

    kept = {k: v for k, v in table.io.properties.items() if not is_secret(k)}
    return load_file_io(kept, table.metadata.location)


def _plain(schema):
    """`schema` with the large and view types Spark's Arrow conversion does not take made plain."""
    import pyarrow as pa

    def plain(t):
        if pa.types.is_large_string(t) or pa.types.is_string_view(t):
            return pa.string()
        if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
            return pa.binary()
        if pa.types.is_large_list(t) or pa.types.is_list(t):
            return pa.list_(plain(t.value_type))
        if pa.types.is_struct(t):
            return pa.struct([pa.field(f.name, plain(f.type), f.nullable) for f in t])
        if pa.types.is_map(t):
            return pa.map_(plain(t.key_type), plain(t.item_type))
        return t

    return pa.schema([pa.field(f.name, plain(f.type), f.nullable) for f in schema])
