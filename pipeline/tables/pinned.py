"""A lakehouse table at one version: what the ETL reads, the manifest records and MLflow shows as lineage."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional


@dataclass(frozen=True)
class DeltaFile:
    """One data file of a pinned Delta version, as a Spark task reads it: `path` (a URL or local path),
    its partition values (logical column -> typed value), and the rows its deletion vector removes
    (row indexes in the file; empty: none)."""
    path: str
    partition: dict = field(default_factory=dict)
    deleted: tuple = ()


@dataclass(frozen=True)
class PinnedTable:
    """`format` (delta | iceberg) table `name` (a Delta folder/URL, an Iceberg identifier) at `version` (a
    Delta version, an Iceberg snapshot id), committed at `committed_ms`. `schema`: the table's logical
    Arrow schema at that version. `units`: what the Spark tasks read (DeltaFile, or pyiceberg FileScanTask),
    `reader`: what they need besides (Delta: the physical column names; Iceberg: metadata, FileIO, projection)."""
    format: str
    name: str
    uri: str
    version: int
    committed_ms: int
    schema: Any
    units: tuple
    reader: dict = field(default_factory=dict)
    honoured: tuple = ()  # what this read applied beyond plain files (deletion vectors, column mapping, ...)
    catalog: Optional[str] = None
    table_id: Optional[str] = None  # Delta metadata id / Iceberg table uuid: a table recreated at the same path differs

    @property
    def pin_key(self) -> str:
        return "data.version" if self.format == "delta" else "data.snapshot_id"

    def describe(self) -> str:
        what = "version" if self.format == "delta" else "snapshot"
        return f"{self.title} table {self.name} at {what} {self.version}"

    @property
    def title(self) -> str:
        return {"delta": "Delta", "iceberg": "Iceberg"}[self.format]

    def record(self) -> dict:
        """The pin as plain values (the manifest's etl_report["table"], MLflow's dataset input)."""
        committed = datetime.fromtimestamp(self.committed_ms / 1000, tz=timezone.utc).isoformat()
        return {"format": self.format, "name": self.name, "uri": self.uri, "version": self.version,
                "committed": committed, "files": len(self.units), "catalog": self.catalog, "table_id": self.table_id,
                "honoured": list(self.honoured)}
