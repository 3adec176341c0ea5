"""`shardline score --output-format iceberg`: the predictions appended to an Iceberg table in one snapshot.

Spark's tasks write the Parquet files (staging.stage_files) under the table's location, `data/score-<id>/`;
the driver then adds them all in one transaction (pyiceberg's add_files: it reads each file's footer for the
manifest's statistics and maps the columns by name), which makes one `append` snapshot. A table that does
not exist is created by that same commit (create_table_transaction); its namespace is created before the
run, when missing.

Not table.append: it takes one Arrow table in this process, so every prediction would be collected on the
driver; here the executors write in parallel and only the file list reaches the driver.

Conflicts: pyiceberg 0.12 retries a commit that lost a race by itself (Transaction.commit_transaction):
it refreshes the table, rebuilds the snapshot on the new head and commits again, with exponential backoff
(table properties commit.retry.num-retries, default 4, and commit.retry.min-wait-ms, default 100), logs
"Commit failed due to a concurrent update, retrying (n/4) in N ms" (logger pyiceberg.table, WARNING) and
deletes the manifests of a commit that failed. So there is no second loop here. The race it does not cover,
two runs creating the table at once, is handled here: the later one appends to the table the first created.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline import storage
from pipeline.errors import TableError
from pipeline.tables.catalog import iceberg_catalog, require
from pipeline.tables.staging import Appended, nullable, stage_files

log = logging.getLogger(__name__)

TOKEN_KEY = "shardline.commit"  # snapshot summary property naming the run's commit: found again on failure


@dataclass
class IcebergTarget:
    """An Iceberg table checked against the scores' schema before any data is written (see prepare)."""
    identifier: str  # namespace.table
    catalog: Any
    schema: Any  # pa.Schema of the scores, every column nullable
    table: Any = None  # the Table as prepare loaded it
    create: Any = None  # the CreateTableTransaction where the table does not exist yet
    location: str = ""
    folder: str = field(default_factory=lambda: f"score-{uuid.uuid4().hex[:12]}")  # under location/data/
    token: str = field(default_factory=lambda: uuid.uuid4().hex)


def prepare(config, identifier: str, schema) -> IcebergTarget:
    """The Iceberg table `identifier` (namespace.table) in the catalog `config` (IcebergConfig), ready to take
    rows of `schema` (pa.Schema), or a TableError naming what is wrong and the fix. Writes no data: a missing
    namespace is created, a missing table is created by the commit."""
    require("pyiceberg", "iceberg")
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    namespace, _, name = identifier.rpartition(".")
    if not namespace or not name:
        raise TableError(f"score output {identifier!r} is not an Iceberg table identifier; with "
                         "--output-format iceberg, --output is namespace.table in the catalog data.iceberg")
    catalog = iceberg_catalog(config)
    target = IcebergTarget(identifier, catalog, nullable(schema))
    try:
        target.table = catalog.load_table(identifier)
    except (NoSuchTableError, NoSuchNamespaceError):
        pass
    if target.table is not None:
        check_schema(target.table, target.schema, identifier)
        target.location = target.table.location()
        return target
    catalog.create_namespace_if_not_exists(namespace)  # create_table_transaction needs it
    target.create = catalog.create_table_transaction(identifier, schema=target.schema)
    target.location = target.create.table_metadata.location
    return target


def check_schema(table, schema, identifier: str) -> None:
    """TableError unless add_files can take files of `schema` into `table`: pyiceberg's own check (columns by
    name, each in the table with the same or a promotable type, no required column missing), and no partition
    spec (the files are written unpartitioned)."""
    # The check add_files itself applies at the commit; run here, it fails before any file is written.
    from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible

    problems = []
    if table.spec().fields:
        problems.append(f"the table is partitioned ({table.spec()})")
    try:
        _check_pyarrow_schema_compatible(table.schema(), schema)
    except ValueError as exc:
        problems.append(str(exc).strip().rstrip("."))
    if problems:
        raise TableError(f"Iceberg table {identifier} cannot take these scores: {'; '.join(problems)}. Write to "
                         "a new table, or align the scores (score.keep_columns, score.probabilities) with the "
                         f"table's columns {table.schema().column_names}. Nothing was written")


def stage(df, target: IcebergTarget) -> list[dict]:
    """The scores' Parquet files, written by Spark's tasks under the table's data/score-<id>/, uncommitted."""
    return stage_files(df, storage.join(target.location, "data", target.folder))


def _urls(target: IcebergTarget, files: list[dict]) -> list[str]:
    # In the location's own form (file:///..., s3://...): the store paths stage returns, re-rooted on it.
    _, root = storage.resolve(target.location)
    return [target.location.rstrip("/") + "/" + f["path"][len(root):].lstrip("/") for f in files]


def commit(target: IcebergTarget, files: list[dict]) -> Optional[int]:
    """Add `files` (stage's) to the table in one snapshot (creating the table where prepare found none);
    returns its id (None: no files, nothing committed to an existing table)."""
    from pyiceberg.exceptions import CommitFailedException, TableAlreadyExistsError

    urls = _urls(target, files)
    properties = {TOKEN_KEY: target.token}
    # No duplicate check: the names carry a random id, and the check reads every manifest of the table.
    if target.create is not None:
        try:
            if urls:
                target.create.add_files(urls, snapshot_properties=properties, check_duplicate_files=False)
            table = target.create.commit_transaction()
            return table.current_snapshot().snapshot_id if urls else None
        except (CommitFailedException, TableAlreadyExistsError) as exc:
            if not target.catalog.table_exists(target.identifier):
                raise
            log.warning("Iceberg table %s was created by a concurrent writer while this run scored (%s); appending "
                        "to it instead", target.identifier, exc)
            target.create, target.table = None, target.catalog.load_table(target.identifier)
            check_schema(target.table, target.schema, target.identifier)
    if not urls:
        return None
    with target.table.transaction() as transaction:  # conflicts: retried by pyiceberg (module docstring)
        transaction.add_files(urls, snapshot_properties=properties, check_duplicate_files=False)
    return target.table.current_snapshot().snapshot_id


def committed_snapshot(target: IcebergTarget) -> Optional[int]:
    """The id of the snapshot carrying this run's token, or None (no table, or not committed)."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        table = target.catalog.load_table(target.identifier)
    except (NoSuchTableError, NoSuchNamespaceError):
        return None
    for snapshot in reversed(table.snapshots()):
        if snapshot.summary is not None and snapshot.summary.get(TOKEN_KEY) == target.token:
            return snapshot.snapshot_id
    return None


def append(df, target: IcebergTarget) -> Appended:
    """Write `df` (the scores, in target.schema's columns) into the table as one snapshot. On any failure the
    run's files are deleted, unless its snapshot is in the table (an outcome the exception left unknown); a
    namespace prepare created stays."""
    folder = storage.join(target.location, "data", target.folder)
    try:
        files = stage(df, target)
        snapshot_id = commit(target, files)
    except BaseException:
        try:
            landed = committed_snapshot(target) is not None
        except Exception:  # the catalog cannot tell: keep the files, a snapshot may name them
            landed = True
        if not landed:
            storage.delete_dir(folder)
            if target.create is not None and not storage.list_files(target.location):
                storage.delete_dir(target.location)  # the folder of a table this run did not get to create
        raise
    if not files:
        storage.delete_dir(folder)  # no rows: the folder stage made stays empty
    rows = sum(f["rows"] for f in files)
    log.info("appended %d rows (%d files) to Iceberg table %s as snapshot %s", rows, len(files), target.identifier,
             snapshot_id)
    return Appended(target.identifier, snapshot_id, _urls(target, files), rows)
