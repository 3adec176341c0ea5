"""The source table a run trained on, as an MLflow dataset input (the run page's Datasets tab): name, source
URI, format, version or snapshot, row count and the shard set's fingerprint.

MLflow's own DeltaDatasetSource writes a path's table without its version, and MLflow has no Iceberg
source: the sources here write the same source types ("delta_table", "iceberg_table") with the version in
their JSON. Loading them back is deltalake's / pyiceberg's job, not MLflow's.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

log = logging.getLogger(__name__)


def _table_source(source_type: str, fields: dict):
    """A DatasetSource whose JSON is `fields`."""
    from mlflow.data.dataset_source import DatasetSource

    class TableSource(DatasetSource):
        @staticmethod
        def _get_source_type() -> str:
            return source_type

        def load(self, **kwargs):
            raise NotImplementedError("read the table with deltalake / pyiceberg at the version in this source")

        @staticmethod
        def _can_resolve(raw_source: Any) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source: Any):
            raise NotImplementedError

        def to_dict(self) -> dict:
            return dict(fields)

        @classmethod
        def from_dict(cls, source_dict: dict):
            return cls()

    return TableSource()


def table_input(table: dict, rows: Optional[int], fingerprint: str, context: str = "training"):
    """The MLflow DatasetInput of `table` (the manifest's etl_report["table"] record)."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    if table["format"] == "delta":  # the JSON of MLflow's DeltaDatasetSource, which leaves a path's version out
        source = _table_source("delta_table", {"path": table["uri"], "delta_table_version": int(table["version"])})
    else:
        source = _table_source("iceberg_table", {"uri": table["uri"], "snapshot_id": int(table["version"])})
    name = f"{table['name']}@{table['version']}"
    dataset = MetaDataset(source=source, name=name, digest=fingerprint.removeprefix("sha256:")[:36])
    tags = {"mlflow.data.context": context, "format": table["format"], "version": str(table["version"]),
            "committed": table.get("committed") or "", "rows": "" if rows is None else str(rows),
            "fingerprint": fingerprint, "source_uri": table["uri"]}
    log.debug("dataset input %s: %s", name, json.dumps(tags))
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(k, v) for k, v in tags.items()])
