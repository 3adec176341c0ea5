"""What a table gained since the version a workflow last trained on: only appended files (their rows are the
new increment), or a commit that removed or changed files (a delete, update, overwrite or compaction: every
row is prepared again), or nothing.

One rule for both formats, by the files of the two pinned versions: the increment is the data files of the
new version that the old one did not have, and it is exact only when every file of the old version is still
there unchanged (same path, same deletion vector or delete files). Delta's change data feed would give the
same inserted rows for an append-only range and is not needed beyond it: any other commit re-prepares
everything anyway.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

from pipeline.errors import TableError
from pipeline.tables.pinned import PinnedTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TableChange:
    kind: str  # none | append | rewrite
    reason: str
    # append: the new files only; rewrite: the whole table at the new version; none: the version last prepared
    pinned: PinnedTable


def _unit_key(pinned: PinnedTable, unit) -> tuple:
    if pinned.format == "delta":
        return unit.path, tuple(unit.deleted)
    return unit.file.file_path, tuple(sorted(d.file_path for d in unit.delete_files))


def _operations(data, since: int, until: int) -> str:
    """The operations committed after `since` up to `until`, for the log line ("DELETE at 3, WRITE at 4")."""
    try:
        if data.source == "delta":
            import deltalake

            table = deltalake.DeltaTable(data.path)
            entries = table.history(limit=max(1, table.version() - since))
            found = sorted((h["version"], h["operation"]) for h in entries if since < h["version"] <= until)
            return ", ".join(f"{op} at {v}" for v, op in found)
        from pipeline.tables.catalog import iceberg_table

        table = iceberg_table(data.iceberg, data.path)
        chain, snapshot = [], table.snapshot_by_id(until)
        while snapshot is not None and snapshot.snapshot_id != since:
            chain.append(f"{snapshot.summary.operation.value if snapshot.summary else '?'} at {snapshot.snapshot_id}")
            snapshot = table.snapshot_by_id(snapshot.parent_snapshot_id) if snapshot.parent_snapshot_id else None
        return ", ".join(reversed(chain))
    except Exception as exc:  # only the log line's detail: the decision does not depend on it
        return f"unknown ({exc})"


def changes_since(data, last: Optional[int]) -> TableChange:
    """`data`'s table now (pinned once) against version `last` (None: never prepared)."""
    from pipeline.config.sources import at_version
    from pipeline.tables.read import pin

    now = pin(data)
    if last is None:
        return TableChange("rewrite", f"first run: every row of {now.describe()}", now)
    if now.version == last:
        return TableChange("none", f"no commit since version {last}, the version last prepared", now)
    try:
        before = pin(at_version(data, last))
    except TableError as exc:  # vacuumed / expired: the increment cannot be told
        return TableChange("rewrite", f"version {last} last prepared can no longer be read ({exc}); preparing every "
                                      f"row of {now.describe()}", now)
    old = {_unit_key(before, u) for u in before.units}
    current = {_unit_key(now, u): u for u in now.units}
    gone = old - set(current)
    if gone:
        what = _operations(data, last, now.version)
        return TableChange("rewrite", f"{len(gone)} data file(s) of version {last} were removed or changed by "
                                      f"{now.describe()} (commits since: {what}): not an append, so every row is "
                                      "prepared again", now)
    added = tuple(u for k, u in current.items() if k not in old)
    if not added:  # commits that changed no data file (table properties, a schema change): no new rows
        return TableChange("none", f"no rows appended since version {last} ({now.describe()}; commits since: "
                                   f"{_operations(data, last, now.version)})", before)
    log.info("%s: %d file(s) appended since version %d", now.describe(), len(added), last)
    return TableChange("append", f"{len(added)} file(s) appended since version {last}",
                       dataclasses.replace(now, units=added))
