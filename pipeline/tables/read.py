"""The configured table pinned (`pin`) and read into a DataFrame by Spark's tasks (`table_frame`)."""
from __future__ import annotations

import logging
from typing import Optional, Sequence

from pipeline.errors import TableError
from pipeline.tables.pinned import PinnedTable

log = logging.getLogger(__name__)


def pin(data) -> PinnedTable:
    """`data` (DataConfig, source delta or iceberg) at its pinned version, or the current one resolved now."""
    from pipeline.config.sources import parse_timestamp

    timestamp = parse_timestamp(data.timestamp) if data.timestamp else None
    if data.source == "delta":
        from pipeline.tables.delta_read import pin_delta

        return pin_delta(data.path, data.version, timestamp)
    from pipeline.tables.iceberg_read import pin_iceberg

    return pin_iceberg(data.iceberg, data.path, data.snapshot_id, timestamp)


def check_columns(pinned: PinnedTable, wanted: Sequence[str]) -> None:
    """Every wanted column is in the pinned version's schema, else a TableError naming it (schema evolution)."""
    missing = [c for c in wanted if c not in pinned.schema.names]
    if missing:
        raise TableError(f"column(s) {missing} are not in {pinned.describe()} (its columns: {pinned.schema.names}); "
                         f"the table's schema changed: pin a version that has them ({pinned.pin_key}), or drop "
                         "them from data.features")


def _groups(units: Sequence, tasks: int) -> list[list]:
    """`units` dealt round-robin into `tasks` groups (files in log order: neighbours are alike in size)."""
    return [list(units[i::tasks]) for i in range(tasks) if units[i::tasks]]


def table_frame(spark, pinned: PinnedTable, columns: Optional[Sequence[str]] = None):
    """A DataFrame of `pinned`'s rows (`columns` only, when given), one Spark task per group of files."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    schema = pinned.schema
    if columns:
        check_columns(pinned, columns)
        schema = pa.schema([schema.field(c) for c in dict.fromkeys(columns)])
    try:
        slots = spark.sparkContext.defaultParallelism
    except Exception:  # Spark Connect has no SparkContext
        slots = 8
    if not pinned.units:
        return spark.createDataFrame([], from_arrow_schema(schema))
    tasks = max(1, min(len(pinned.units), slots * 4))
    if pinned.format == "delta":
        from urllib.parse import urlparse

        from pipeline import storage
        from udfs.table_read import make_delta_read_fn

        filesystems, groups, index = [], [], {}
        for group in _groups(pinned.units, tasks):
            entries = []
            for unit in group:
                fs, path = storage.resolve(unit.path)
                key = urlparse(unit.path)[:2]  # one file system per (scheme, bucket): shipped once, not per file
                if key not in index:
                    index[key] = len(filesystems)
                    filesystems.append(fs)
                entries.append((index[key], path, unit.partition, unit.deleted))
            groups.append(entries)
        body = make_delta_read_fn(filesystems, groups, schema, dict(pinned.reader["physical"]))
    else:
        from udfs.table_read import make_iceberg_read_fn

        groups = _groups(pinned.units, tasks)
        body = make_iceberg_read_fn(pinned.reader["metadata"], pinned.reader["io"], _projected(pinned, schema),
                                    groups, schema)
    return spark.range(len(groups), numPartitions=len(groups)).mapInArrow(body, from_arrow_schema(schema))


def _projected(pinned: PinnedTable, schema):
    """The Iceberg projection narrowed to `schema`'s columns (pyiceberg reads only those)."""
    projection = pinned.reader["projection"]
    if list(schema.names) == [f.name for f in projection.fields]:
        return projection
    return projection.select(*schema.names)
