"""Test helpers: small real Delta and Iceberg tables (written by deltalake / pyiceberg) whose f0 column is the
row id, and the ids a shard set holds (f0 read back from the unstandardized shards)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

SCHEMA = pa.schema([("id", pa.int64()), ("f0", pa.float64()), ("f1", pa.float64()), ("label", pa.string())])


def rows(start: int, count: int, seed: int = 0) -> pa.Table:
    ids = np.arange(start, start + count)
    rng = np.random.default_rng(seed + start)
    f1 = rng.normal(size=count)
    return pa.table({"id": ids, "f0": ids.astype(float), "f1": f1, "label": np.where(f1 > 0, "up", "down")},
                    schema=SCHEMA)


def data_config(workdir, source: str, path: str, **data) -> dict:
    return {"name": "tables", "workdir": str(workdir), "parallelism": {"data": 2},
            "train": {"batch_size": 8, "epochs": 2}, "model": {"hidden": [8]},
            "data": {"source": source, "path": path, "id_column": "id", "standardize": False,
                     "features": ["f0", "f1"], **data}}


def shard_ids(manifest) -> list[int]:
    """Every row id in the shard set (f0, unstandardized), sorted."""
    from pipeline.data import read_tensors

    ids = []
    for split, info in manifest.splits.items():
        for rank in range(len(info.shards)):
            inputs, _ = read_tensors(manifest.files(split, rank))
            ids.extend(int(v) for v in inputs["numeric"][:, 0].tolist())
    return sorted(ids)


def iceberg_catalog_config(tmp_path, name: str = "test") -> dict:
    return {"name": name, "catalog": {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
                                      "warehouse": f"file://{tmp_path}/warehouse"}}


def iceberg_table(tmp_path, identifier: str, *appended: pa.Table):
    """(catalog settings, catalog, table): a new Iceberg table of SCHEMA in the SQL catalog of `tmp_path`, one
    snapshot per `appended` table."""
    from pipeline.config.sources import IcebergConfig
    from pipeline.tables.catalog import iceberg_catalog

    settings = iceberg_catalog_config(tmp_path)
    catalog = iceberg_catalog(IcebergConfig(**settings))
    namespace = identifier.split(".")[0]
    if (namespace,) not in catalog.list_namespaces():
        catalog.create_namespace(namespace)
    table = catalog.create_table(identifier, schema=SCHEMA)
    for part in appended:
        table.append(part)
    return settings, catalog, table
