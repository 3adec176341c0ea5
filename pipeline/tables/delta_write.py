"""`shardline score --output-format delta`: the predictions appended to a Delta table in one commit.

Spark's tasks write the Parquet files (staging.stage_files) into a fresh sub-folder of the table,
`score-<id>/`; the driver then commits them all as one transaction of `add` actions (delta-rs:
DeltaTable.create_write_transaction, or create_table_with_add_actions where no table exists yet, so the
table is born holding the scores). Until that commit no version of the log names the files, so no reader
sees them; a failed run deletes them.

Not write_deltalake: it writes an Arrow stream from this process, so every prediction would cross to the
driver and be written by one process; here the executors write in parallel and only the file list
(path, rows, size) reaches the driver.

Conflicts: delta-rs retries a conflicting commit on its own (silently, up to 15 times); that is turned off
(max_commit_retries=0) so that each retry happens here: logged, after a short backoff, and after the table
is read again and its schema checked again (a concurrent writer may have changed it).

A commit can land while its answer is lost (an object store's PUT that succeeded, then timed out and was
retried: the retry finds the log file taken and reports a conflict). Each commit carries a token in its
commitInfo (TOKEN_KEY), so before any retry the history since the version the first attempt read is searched
for it: found, the run's commit is that version and is not written again (a second commit would add the
same files twice and double the rows).
"""
from __future__ import annotations

import json
import logging
import random
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline import storage
from pipeline.errors import TableError
from pipeline.tables.catalog import require
from pipeline.tables.staging import Appended, nullable, stage_files

log = logging.getLogger(__name__)

ATTEMPTS = 8  # commits tried per score run; a retry waits BACKOFF_S * 2**n (capped at 2 s) plus jitter
BACKOFF_S = 0.1
TOKEN_KEY = "shardline.commit"  # commitInfo metadata naming the run's commit: found again in the history


@dataclass
class DeltaTarget:
    """A Delta table checked against the scores' schema before anything is written (see prepare)."""
    output: str  # the folder or URL as given
    uri: str  # what delta-rs opens: an absolute local path or the store URL
    schema: Any  # pa.Schema of the scores, every column nullable
    table: Any = None  # the DeltaTable as prepare read it; None: the commit creates the table
    existed: bool = False  # whether the output folder was there before (else a failed run removes it)
    folder: str = field(default_factory=lambda: f"score-{uuid.uuid4().hex[:12]}")  # the run's data sub-folder
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The table version the commit's first attempt read (-1: no table yet), set by commit: the run's own
    # commit can only be a later version, so the landed check searches the history back to here. None: the
    # whole history.
    read_version: Optional[int] = None


def _uri(output: str) -> str:
    if storage.is_remote(output):
        return output.rstrip("/")
    _, path = storage.resolve(output)
    return path


def _open(uri: str):
    deltalake = require("deltalake", "delta")
    return deltalake.DeltaTable(uri) if deltalake.DeltaTable.is_deltatable(uri) else None


def prepare(output: str, schema) -> DeltaTarget:
    """The Delta table at `output` (folder or URL) ready to take rows of `schema` (pa.Schema), or a TableError
    naming what is wrong and the fix; writes nothing. A path that does not exist (or an empty folder) becomes
    a new table at the commit."""
    import pyarrow.fs as pafs

    target = DeltaTarget(output, _uri(output), nullable(schema))
    target.table = _open(target.uri)
    fs, path = storage.resolve(output)
    kind = fs.get_file_info(path).type
    target.existed = kind != pafs.FileType.NotFound
    if target.table is not None:
        check_schema(target.table, target.schema, output)
        return target
    if kind == pafs.FileType.File:
        raise TableError(f"score output {output} is a file, not a Delta table; give a Delta table's folder, or a "
                         "new path for a new table")
    entries = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)) if target.existed else []
    if entries:
        names = sorted(e.base_name for e in entries)
        raise TableError(f"score output {output} exists and is not a Delta table (no _delta_log/; it holds "
                         f"{names[:3]}{' ...' if len(names) > 3 else ''}); give a Delta table's folder or a new path, "
                         "or write Parquet there with --output-format parquet. Nothing was written")
    return target


def check_schema(table, schema, name: str) -> None:
    """TableError unless the Delta table takes the scores' columns as they are: the same names and types, each
    nullable, no partition columns and no column mapping (the files are written by name, unpartitioned)."""
    deltalake = require("deltalake", "delta")
    theirs = {f.name: f for f in table.schema().fields}
    ours = {f.name: f for f in deltalake.Schema.from_arrow(schema).fields}
    problems = [f"{n} is missing in the table" for n in ours if n not in theirs]
    problems += [f"the table has {n}, which the scores lack" for n in theirs if n not in ours]
    problems += [f"{n} is {_type(theirs[n].type)} in the table, the scores' is {_type(f.type)}"
                 for n, f in ours.items() if n in theirs and theirs[n].type != f.type]
    problems += [f"{n} is NOT NULL in the table" for n, f in theirs.items() if n in ours and not f.nullable]
    metadata = table.metadata()
    if metadata.partition_columns:
        problems.append(f"the table is partitioned by {list(metadata.partition_columns)}")
    if metadata.configuration.get("delta.columnMapping.mode", "none") != "none":
        problems.append("the table uses column mapping")
    if problems:
        raise TableError(f"Delta table {name} cannot take these scores: {'; '.join(problems)}. Write to a new "
                         f"table, or align the scores (score.keep_columns, score.probabilities) with the table's "
                         f"columns {sorted(theirs)}. Nothing was written")


def _type(delta_type) -> str:
    return re.sub(r'PrimitiveType\("(\w+)"\)', r"\1", repr(delta_type))  # long, ArrayType(float, ...)


def stage(df, target: DeltaTarget) -> list[dict]:
    """The scores' Parquet files, written by Spark's tasks into the table's `score-<id>/` folder, uncommitted."""
    return stage_files(df, storage.join(target.output, target.folder))


def commit(target: DeltaTarget, files: list[dict]) -> Optional[int]:
    """Commit `files` (stage's) to the table as one transaction; returns the table version it made (None: no
    files for a table that exists, nothing committed). A conflict with a concurrent writer's commit is retried
    (ATTEMPTS in all), each retry logged, unless this run's own commit is found to have landed."""
    deltalake = require("deltalake", "delta")
    from deltalake.exceptions import CommitFailedError, DeltaError
    from deltalake.transaction import AddAction, CommitProperties, create_table_with_add_actions

    _, root = storage.resolve(target.output)
    actions = [AddAction(f["path"][len(root):].lstrip("/"), f["size"], {}, f["mtime_ms"], True,
                         json.dumps({"numRecords": f["rows"]})) for f in files]
    properties = CommitProperties(max_commit_retries=0, custom_metadata={TOKEN_KEY: target.token})
    target.read_version = target.table.version() if target.table is not None else -1
    for attempt in range(1, ATTEMPTS + 1):
        try:
            if target.table is None:
                create_table_with_add_actions(target.uri, deltalake.Schema.from_arrow(target.schema), actions,
                                              mode="error", commit_properties=properties)
            elif actions:
                # The table's own schema: an append must not carry a metadata (schema) change.
                target.table.create_write_transaction(actions, mode="append", schema=target.table.schema(),
                                                      commit_properties=properties)
            else:
                return None  # no rows and the table exists: nothing to commit
            break
        except DeltaError as exc:
            # A conflict: another commit took the version this one read (CommitFailedError), or another
            # run created the table first. Anything else is no conflict.
            if not isinstance(exc, CommitFailedError) and not (target.table is None and _open(target.uri)):
                raise
            # Or this run's own commit, landed with its answer lost: then it is done, and a retry would
            # commit the same files a second time.
            landed = committed_version(target.uri, target.token, target.read_version)
            if landed is not None:
                log.warning("Delta table %s: the commit of %d files reported a conflict (%s) but is in the "
                            "table's history as version %d: not retried", target.output, len(files), exc, landed)
                return landed
            if attempt == ATTEMPTS:
                raise TableError(f"Delta table {target.output}: the commit of {len(files)} score files still "
                                 f"conflicted with concurrent writers after {ATTEMPTS} attempts ({exc}); run the "
                                 "score again, or write fewer runs to the table at once. Nothing was written") from None
            wait = min(BACKOFF_S * 2 ** (attempt - 1), 2.0) * (1 + 0.2 * random.random())
            log.warning("Delta table %s: commit of %d files conflicted with a concurrent writer (%s); retry %d/%d "
                        "in %.0f ms", target.output, len(files), exc, attempt, ATTEMPTS - 1, wait * 1e3)
            time.sleep(wait)
            target.table = _open(target.uri)
            if target.table is not None:
                check_schema(target.table, target.schema, target.output)
    return committed_version(target.uri, target.token, target.read_version)


def committed_version(uri: str, token: str, since: Optional[int] = -1) -> Optional[int]:
    """The version whose commitInfo carries `token` among the commits after version `since` (the version the run
    read before its first attempt; -1 or None: every commit), or None: not committed.

    Searched back to `since`, not a fixed depth: with many concurrent writers the run's commit may lie any
    number of commits back, and a wrong "not committed" would delete files a commit names."""
    since = -1 if since is None else since
    table = _open(uri)
    count = table.version() - since if table is not None else 0
    if count <= 0:
        return None  # no table, or no commit since the run read it
    # Newest first, back to version since + 1. delta-rs 1.6.6 also lists commits made after it loaded the
    # table (by a concurrent writer) but numbers the entries down from the loaded version, so the versions
    # are counted here from the oldest entry instead (since + 1).
    entries = table.history(count)
    for i, entry in enumerate(entries):
        if entry.get(TOKEN_KEY) == token:
            return since + len(entries) - i
    return None


def append(df, target: DeltaTarget) -> Appended:
    """Write `df` (the scores, in target.schema's columns) into the table as one commit. On any failure the
    run's files are deleted (and a folder this run created), unless the commit is in the table's history."""
    folder = storage.join(target.output, target.folder)
    try:
        files = stage(df, target)
        version = commit(target, files)
    except BaseException:
        try:
            landed = committed_version(target.uri, target.token, target.read_version) is not None
        except Exception:  # the store cannot tell: keep the files, a commit may name them
            landed = True
        if not landed:
            storage.delete_dir(folder)
            if not target.existed and not storage.list_files(target.output):
                storage.delete_dir(target.output)
        raise
    if not files:
        storage.delete_dir(folder)  # no rows: the folder stage made stays empty
    rows = sum(f["rows"] for f in files)
    log.info("appended %d rows (%d files) to Delta table %s as version %s", rows, len(files), target.output, version)
    return Appended(target.output, version, [storage.url_of(target.output, f["path"]) for f in files], rows)
