"""Test helper: give a real Delta table deletion vectors.

``deltalake`` (delta-rs) can read deletion vectors (DVs) but cannot write them:
its DELETE rewrites data files.  Shardline's Delta reader must never return rows
that a DV marks as deleted, so its tests need tables that really carry DVs.
:func:`add_deletion_vector` commits one, the way Spark/Databricks does, following
the Delta protocol (delta-io/delta ``PROTOCOL.md``):

* "Deletion Vectors" / "Table Features": the table is upgraded to reader
  version 3 / writer version 7 with ``deletionVectors`` in both feature lists.
  Features implied by the table's legacy protocol versions are listed
  explicitly (as Spark does when it upgrades a table), and
  ``delta.enableDeletionVectors=true`` is set in the table configuration.
* "Add File and Remove File": the commit removes the logical file
  ``(path, old DV)`` and adds ``(path, new DV)``; the add keeps every field of
  the original add (partitionValues, size, modificationTime, stats, tags, row
  tracking fields), with ``stats.tightBounds`` set to false, because min/max
  values may now be wider than the valid rows ("Per-file Statistics").

The DV's bytes (the RoaringBitmapArray, its file or inline storage, Z85) are
:mod:`delta_dv_format`'s.

Run this module to check the helper against delta-rs itself::

    .venv/bin/python tests/pipeline/tables/delta_dv.py
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote

if __package__:
    from . import delta_dv_format as dv_format
else:  # run as a script (the self-check): this folder is on sys.path
    import delta_dv_format as dv_format

__all__ = ["add_deletion_vector"]

# ---------------------------------------------------------------------------
# Log replay (enough of it for tables written by deltalake / Spark)
# ---------------------------------------------------------------------------


def _checkpoint_rows(log_dir: Path, version: int) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    files = sorted(log_dir.glob(f"{version:020d}.checkpoint*.parquet"))
    if not files:
        raise FileNotFoundError(f"no checkpoint parquet for version {version} in {log_dir}")
    actions: list[dict[str, Any]] = []
    for file in files:
        for row in pq.read_table(file).to_pylist():
            for kind in ("protocol", "metaData", "add"):
                action = row.get(kind)
                if action is None:
                    continue
                action = {k: v for k, v in action.items() if v is not None}
                for key in ("partitionValues", "tags", "configuration", "options"):
                    if isinstance(action.get(key), list):  # parquet maps -> key/value pairs
                        action[key] = dict(action[key])
                if kind == "metaData" and isinstance(action.get("format"), dict):
                    fmt = action["format"]
                    if isinstance(fmt.get("options"), list):
                        fmt["options"] = dict(fmt["options"])
                action.pop("stats_parsed", None)
                action.pop("partitionValues_parsed", None)
                actions.append({kind: action})
    return actions


def _replay(table_path: Path) -> tuple[int, dict, dict, dict[str, dict]]:
    """(latest version, protocol, metaData, {path: add}) of the table."""
    log_dir = table_path / "_delta_log"
    commits = sorted(int(p.name[:20]) for p in log_dir.glob("*.json") if p.name[:20].isdigit())
    if not commits:
        raise FileNotFoundError(f"{table_path} is not a Delta table (no commits)")
    start, actions = 0, []
    last_cp = log_dir / "_last_checkpoint"
    if last_cp.exists():
        cp_version = json.loads(last_cp.read_text())["version"]
        actions = _checkpoint_rows(log_dir, cp_version)
        start = cp_version + 1
    for version in commits:
        if version < start:
            continue
        with open(log_dir / f"{version:020d}.json") as fh:
            actions.extend(json.loads(line) for line in fh if line.strip())
    protocol: dict = {}
    metadata: dict = {}
    files: dict[str, dict] = {}
    for action in actions:
        if "protocol" in action:
            protocol = action["protocol"]
        elif "metaData" in action:
            metadata = action["metaData"]
        elif "add" in action:
            files[action["add"]["path"]] = action["add"]
        elif "remove" in action:
            files.pop(action["remove"]["path"], None)
    return commits[-1], protocol, metadata, files


# Table features implied by legacy protocol versions (PROTOCOL.md, "Table Features").
_LEGACY_WRITER_FEATURES = {
    2: ["appendOnly", "invariants"],
    3: ["checkConstraints"],
    4: ["changeDataFeed", "generatedColumns"],
    5: ["columnMapping"],
    6: ["identityColumns"],
}
_LEGACY_READER_FEATURES = {2: ["columnMapping"]}


def _upgraded_protocol(protocol: dict) -> dict:
    reader_v = int(protocol.get("minReaderVersion", 1))
    writer_v = int(protocol.get("minWriterVersion", 2))
    reader = list(protocol.get("readerFeatures") or [])
    writer = list(protocol.get("writerFeatures") or [])
    if reader_v < 3:
        for v, feats in _LEGACY_READER_FEATURES.items():
            if reader_v >= v:
                reader += feats
    if writer_v < 7:
        for v, feats in _LEGACY_WRITER_FEATURES.items():
            if writer_v >= v:
                writer += feats
    reader.append("deletionVectors")
    writer += reader  # every reader feature must also be a writer feature
    dedup = lambda xs: list(dict.fromkeys(xs))  # noqa: E731 - keep order
    return {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": dedup(reader),
        "writerFeatures": dedup(writer),
    }


def _num_records(table_path: Path, add: dict) -> int:
    stats = json.loads(add["stats"]) if add.get("stats") else {}
    if "numRecords" in stats:
        return int(stats["numRecords"])
    import pyarrow.parquet as pq

    return pq.read_metadata(table_path / unquote(add["path"])).num_rows


# ---------------------------------------------------------------------------
# The helper
# ---------------------------------------------------------------------------


def add_deletion_vector(
    table_path: str,
    file_name: str,
    deleted_rows: list[int],
    *,
    storage_type: str = "u",
) -> int:
    """Commit a new table version in which ``file_name`` carries a deletion vector.

    ``table_path`` is a local Delta table (e.g. written by
    ``deltalake.write_deltalake``), ``file_name`` the ``path`` of one of its add
    actions (as in the log, or URL-decoded) and ``deleted_rows`` 0-based row
    indexes within that file.  Rows already deleted by an existing DV stay
    deleted (the new DV is the union).  ``storage_type`` is ``"u"`` (DV file
    next to the data, Spark's choice) or ``"i"`` (inline in the log).
    Returns the committed version.
    """
    root = Path(table_path)
    version, protocol, metadata, files = _replay(root)
    add = files.get(file_name)
    if add is None:
        matches = [a for p, a in files.items() if unquote(p) == file_name or p == unquote(file_name)]
        if len(matches) != 1:
            raise KeyError(f"{file_name!r} is not a live file of {table_path} at version {version}")
        add = matches[0]

    num_records = _num_records(root, add)
    rows = set(int(r) for r in deleted_rows)
    if not rows:
        raise ValueError("deleted_rows is empty")
    bad = sorted(r for r in rows if r < 0 or r >= num_records)
    if bad:
        raise ValueError(f"row indexes {bad} out of range for {num_records} rows in {file_name}")
    old_dv = add.get("deletionVector")
    if old_dv:
        rows |= set(dv_format.read_deletion_vector(table_path, old_dv))

    bitmap = dv_format.serialize_roaring_bitmap_array(sorted(rows))
    descriptor = dv_format.write_deletion_vector(root, bitmap, storage_type)
    descriptor["cardinality"] = len(rows)

    now = int(time.time() * 1000)
    actions: list[dict[str, Any]] = []
    new_deleted = len(rows) - (int(old_dv["cardinality"]) if old_dv else 0)
    actions.append(
        {
            "commitInfo": {
                "timestamp": now,
                "operation": "DELETE",
                "operationParameters": {"predicate": json.dumps(["<test deletion vector>"])},
                "readVersion": version,
                "isolationLevel": "WriteSerializable",
                "isBlindAppend": False,
                "operationMetrics": {
                    "numRemovedFiles": "0",
                    "numAddedFiles": "0",
                    "numDeletedRows": str(new_deleted),
                    "numDeletionVectorsAdded": "1",
                    "numDeletionVectorsRemoved": "1" if old_dv else "0",
                    "numDeletionVectorsUpdated": "0",
                },
                "engineInfo": "shardline-tests/delta_dv",
                "txnId": str(uuid.uuid4()),
            }
        }
    )

    new_protocol = _upgraded_protocol(protocol)
    if new_protocol != protocol:
        actions.append({"protocol": new_protocol})
    config = dict(metadata.get("configuration") or {})
    if config.get("delta.enableDeletionVectors") != "true":
        config["delta.enableDeletionVectors"] = "true"
        actions.append({"metaData": {**metadata, "configuration": config}})

    remove: dict[str, Any] = {
        "path": add["path"],
        "deletionTimestamp": now,
        "dataChange": True,
        "extendedFileMetadata": True,
        "partitionValues": add.get("partitionValues") or {},
        "size": add["size"],
    }
    for key in ("stats", "tags", "deletionVector", "baseRowId", "defaultRowCommitVersion"):
        if add.get(key) is not None:
            remove[key] = add[key]
    actions.append({"remove": remove})

    stats = json.loads(add["stats"]) if add.get("stats") else {}
    stats["numRecords"] = num_records  # required with a DV
    stats["tightBounds"] = False  # bounds may now include deleted values
    new_add = {k: v for k, v in add.items() if v is not None}  # null == absent
    new_add.update(dataChange=True, stats=json.dumps(stats, separators=(",", ":")))
    new_add["deletionVector"] = descriptor
    actions.append({"add": new_add})

    new_version = version + 1
    commit = root / "_delta_log" / f"{new_version:020d}.json"
    body = "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)
    with open(commit, "x") as fh:  # fail rather than clobber a concurrent commit
        fh.write(body)
    return new_version


# ---------------------------------------------------------------------------
# Self-check against delta-rs
# ---------------------------------------------------------------------------


def _self_check() -> None:  # pragma: no cover - run by hand
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import DeltaTable, write_deltalake

    dv_format.self_check()

    def dv_masks(dt: DeltaTable) -> dict[str, list[bool]]:
        batches = pa.RecordBatchReader.from_stream(dt.deletion_vectors()).read_all().to_pylist()
        return {row["filepath"]: row["selection_vector"] for row in batches}

    def check(partition_by: list[str] | None, storage_type: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t")
            write_deltalake(
                path,
                pa.table({"id": pa.array([0, 1, 2, 3, 4], pa.int64()), "part": ["a", "a", "b", "a", "b"]}),
                partition_by=partition_by,
            )
            write_deltalake(
                path,
                pa.table({"id": pa.array([10, 11, 12, 13], pa.int64()), "part": ["a"] * 4}),
                mode="append",
                partition_by=partition_by,
            )
            before = DeltaTable(path)
            prev = before.version()
            adds = pa.table(before.get_add_actions(flatten=True)).to_pylist()
            target = max(adds, key=lambda a: a["num_records"])
            file_name = target["path"]
            deleted = [0, 2] if target["num_records"] > 2 else [0]
            ids_in_file = pq.read_table(os.path.join(path, file_name), columns=["id"]).column("id").to_pylist()
            deleted_ids = {ids_in_file[i] for i in deleted}

            new_version = add_deletion_vector(path, file_name, deleted, storage_type=storage_type)
            dt = DeltaTable(path)
            print(f"[partition_by={partition_by}, storage={storage_type!r}] file={file_name}")
            print("  version:", prev, "->", dt.version(), "(returned", new_version, ")")
            assert dt.version() == new_version == prev + 1
            print("  protocol:", dt.protocol())
            print("  configuration:", dt.metadata().configuration)

            masks = dv_masks(dt)
            print("  deletion_vectors():", masks)
            (filepath,) = masks
            assert filepath.endswith(file_name), filepath
            mask = masks[filepath]
            assert [i for i, keep in enumerate(mask) if not keep] == deleted, mask

            all_ids = sorted(DeltaTable(path, version=prev).to_pyarrow_table().column("id").to_pylist())
            expected = sorted(set(all_ids) - deleted_ids)
            print("  ids at previous version:", all_ids)

            from deltalake import QueryBuilder

            qb = pa.RecordBatchReader.from_stream(QueryBuilder().register("t", dt).execute("select id from t")).read_all()
            qb_ids = sorted(qb.column("id").to_pylist())
            print("  QueryBuilder ids:", qb_ids)
            assert qb_ids == expected, (qb_ids, expected)

            for name, read in (
                ("to_pyarrow_table", lambda: dt.to_pyarrow_table()),
                ("to_pyarrow_dataset", lambda: dt.to_pyarrow_dataset().to_table()),
            ):
                try:
                    ids = sorted(read().column("id").to_pylist())
                    print(f"  {name} ids:", ids, "(honours DV)" if ids == expected else "(IGNORES DV)")
                except Exception as exc:  # noqa: BLE001 - report delta-rs behaviour
                    print(f"  {name} raised {type(exc).__name__}: {exc}")
            try:
                print("  count():", dt.count())
            except Exception as exc:  # noqa: BLE001
                print(f"  count() raised {type(exc).__name__}: {exc}")

            old_ids = sorted(DeltaTable(path, version=prev).to_pyarrow_table().column("id").to_pylist())
            assert old_ids == all_ids and len(old_ids) == 9
            assert dv_masks(DeltaTable(path, version=prev)) == {}

            # A second DV on the same file is the union of both.
            more = [deleted[-1] + 1] if deleted[-1] + 1 < target["num_records"] else []
            if more:
                add_deletion_vector(path, file_name, more, storage_type=storage_type)
                mask = next(iter(dv_masks(DeltaTable(path)).values()))
                assert [i for i, keep in enumerate(mask) if not keep] == sorted(deleted + more), mask
                print("  second DV (union) ok:", sorted(deleted + more))

    for partition_by in (None, ["part"]):
        for storage_type in ("u", "i"):
            check(partition_by, storage_type)
    print("self-check OK")


if __name__ == "__main__":
    _self_check()
