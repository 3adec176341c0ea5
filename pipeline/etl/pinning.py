"""A lakehouse source pinned once per ETL, and the shard set it made reused while nothing that shapes it
changed.

A Delta version or an Iceberg snapshot never changes, so a shard set made from one (with the same data,
split and shard settings) is the shard set the ETL would make again: `shardline run` at the same version
trains on it without re-reading the table, and the MLflow input then carries the same fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Optional

from pipeline.config.schema import DataConfig, PipelineConfig
from pipeline.config.sources import at_version
from pipeline.config.workdir import Workdir

log = logging.getLogger(__name__)

TABLE_SOURCES = ("delta", "iceberg")
# DataConfig keys of the training loader, not of the shards: changing them keeps the shard set.
_LOADER_KEYS = ("reader", "shuffle_buffer_rows", "shuffle", "reader_threads", "validation_cache_mb")


def pin_source(data: DataConfig):
    """(`data` with its table version pinned, the PinnedTable), or (`data`, None) for other sources. The
    version is resolved here, once: a commit made while the ETL runs is not read."""
    if data.source not in TABLE_SOURCES:
        return data, None
    from pipeline.tables.read import pin

    pinned = pin(data)
    return at_version(data, pinned.version), pinned


def source_report(data: DataConfig, pinned, key: Optional[str]) -> dict:
    """The manifest's record of where its rows came from (etl_report)."""
    report = {"source": data.source, "path": data.path}
    if pinned is not None:
        report.update(table=pinned.record(), etl_key=key)
    return report


# Raised when the ETL or a table reader changes what it writes for the same input: older sets are not reused.
ETL_FORMAT = 1


def etl_key(cfg: PipelineConfig, statistics, pinned) -> Optional[str]:
    """What shapes the shard set of a pinned table (None where the ETL must always run: frozen statistics)."""
    if statistics is not None:
        return None
    data = cfg.data.model_dump(mode="json", exclude=set(_LOADER_KEYS))
    # The table's identity too: a table dropped and recreated at the same path starts at version 0 again.
    # train.batch_size: the ETL checks every worker gets a batch of each split (etl/checks.py).
    shape = {"data": data, "workers": cfg.parallelism.data, "shards": cfg.shards.model_dump(mode="json"),
             "name": cfg.name, "batch_size": cfg.train.batch_size, "format": ETL_FORMAT,
             "table": [pinned.uri, pinned.table_id, pinned.committed_ms]}
    return "sha256:" + hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


def reusable(cfg: PipelineConfig, key: Optional[str]):
    """The committed shard set of `cfg` when the same pinned table and settings made it, else None."""
    if key is None:
        return None
    from pipeline.errors import ManifestError
    from pipeline.shards import load_manifest

    try:
        manifest = load_manifest(Workdir.of(cfg).shards)
    except (ManifestError, OSError):
        return None
    if manifest.etl_report.get("etl_key") != key:
        return None
    return manifest


def data_as_etled(data: DataConfig, etl_report: dict) -> DataConfig:
    """`data` pinned at the version its shard set was made from (the served model's input example is read
    from the rows the model trained on, not from whatever the table holds now)."""
    table = etl_report.get("table")
    if data.source not in TABLE_SOURCES or not table:
        return data
    return at_version(data, table["version"])


def trained_on(manifest) -> str:
    """One line: the source (a table at its version), the rows read and the shard set's fingerprint."""
    report = manifest.etl_report
    table = report.get("table")
    if table:
        what = "version" if table["format"] == "delta" else "snapshot"
        source = f"{table['format'].capitalize()} table {table['name']} at {what} {table['version']}"
    elif report.get("parts"):
        source = f"{len(report['parts'])} workflow partitions"
    else:
        source = f"{report.get('source', 'the')} source" + (f" {report['path']}" if report.get("path") else "")
    rows = report.get("input_rows")
    return f"{source}{f', {rows} rows' if rows is not None else ''} (shard set {manifest.fingerprint})"
